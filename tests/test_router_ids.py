"""Request ids and bootstrap rooms are unguessable: what a client sees of them (``X-Request-Id`` comes back
on every answer, a 401 included) tells nothing of the next ones.

The attack this replays: with a Mersenne Twister, 624 outputs of 32 bits (156 ids of 128 bits) give its whole
state by inverting the tempering (Matsumoto & Nishimura 1998, the tempering of ``genrand_int32``), and then
every later room and id; a party that can reach a prefill's bootstrap server registers a victim's room first.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

from pd.router import rooms


def _untemper(y: int) -> int:
    """The MT19937 state word that tempers to ``y``."""
    y ^= y >> 18
    y ^= (y << 15) & 0xEFC60000
    t = y
    for _ in range(5):
        t = y ^ ((t << 7) & 0x9D2C5680)
    y = t
    t = y
    for _ in range(3):
        t = y ^ (t >> 11)
    return t & 0xFFFFFFFF


def _clone_from_ids(ids: list[str]) -> random.Random:
    """A Mersenne Twister in the state the generator behind ``ids`` (``pdr-`` + 128 bits, 156 of them) is in
    after them, if it is one. ``getrandbits(128)`` fills the least significant 32 bits first."""
    words = []
    for rid in ids:
        value = int(rid.removeprefix("pdr-"), 16)
        words += [(value >> (32 * i)) & 0xFFFFFFFF for i in range(4)]
    clone = random.Random()
    clone.setstate((3, tuple(_untemper(w) for w in words[-624:]) + (624,), None))
    return clone


def test_the_attack_works_on_a_mersenne_twister():
    """The check below is only as good as the attack: it must predict a Mersenne Twister exactly."""
    mt = random.Random(os.urandom(32))
    ids = [f"pdr-{mt.getrandbits(128):032x}" for _ in range(156)]
    clone = _clone_from_ids(ids)
    assert clone.getrandbits(63) == mt.getrandbits(63)
    assert f"pdr-{clone.getrandbits(128):032x}" == f"pdr-{mt.getrandbits(128):032x}"


def test_156_ids_do_not_predict_the_next_room_or_id():
    ids = [rooms.new_rid() for _ in range(156)]
    clone = _clone_from_ids(ids)
    guesses = {clone.getrandbits(63) for _ in range(64)}
    assert not guesses & {rooms.new_room() for _ in range(64)}
    assert f"pdr-{clone.getrandbits(128):032x}" != rooms.new_rid()


def test_rooms_and_ids_are_fresh_and_in_range():
    drawn = [rooms.new_room() for _ in range(5000)]
    assert len(set(drawn)) == len(drawn) and all(0 <= r < rooms.ROOM_LIMIT for r in drawn)
    assert max(drawn) >= 2**62  # the top bit of the 63 is used
    ids = [rooms.new_rid() for _ in range(5000)]
    assert len(set(ids)) == len(ids) and all(len(i) == 36 and int(i[4:], 16) >= 0 for i in ids)


def test_a_forked_child_never_repeats_its_parents_draws():
    """Rooms come from a buffer of CSPRNG bytes; a child that kept its parent's buffer would hand out the
    parent's next rooms too."""
    code = ("import os, sys; from pd.router import rooms; rooms.new_room(); r, w = os.pipe(); pid = os.fork()\n"
            "if pid == 0:\n    os.write(w, str(rooms.new_room()).encode()); os._exit(0)\n"
            "os.waitpid(pid, 0); child = int(os.read(r, 64)); print(child, rooms.new_room())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child, parent = map(int, out.stdout.split())
    assert child != parent
