"""Why a worker's placement-group bundle fits no node of the Ray cluster, in words a user can act on.

The launcher asks Ray for one STRICT_PACK bundle per worker (``{"GPU": tp_size, **placement.resources}``
with ``placement.node_labels`` as its label selector). When no alive node can hold it, Ray only
logs autoscaler errors and the placement group never becomes ready; this module names the missing
resource or label up front. Label selector values follow Ray's syntax (``value``, ``!value``,
``in(a,b)``, ``!in(a,b)``; ray.util.scheduling_strategies / "Label selectors" in Ray's docs).
"""

from __future__ import annotations

from typing import Optional


def _label_ok(labels: dict, key: str, want: str) -> bool:
    have = labels.get(key)
    negate = want.startswith("!")
    want = want[1:] if negate else want
    if want.startswith("in(") and want.endswith(")"):
        hit = have in [v.strip() for v in want[3:-1].split(",")]
    else:
        hit = have == want
    return hit != negate


def _node_gap(bundle: dict[str, float], labels: dict[str, str], node: dict) -> Optional[str]:
    have = node.get("Resources", {})
    for name, amount in bundle.items():
        if have.get(name, 0) < amount:
            return f"{name} {have.get(name, 0):g} < {amount:g}"
    for key, want in labels.items():
        if not _label_ok(node.get("Labels", {}), key, want):
            return f"label {key}={node.get('Labels', {}).get(key)!r} does not match {want!r}"
    return None


def unplaceable_reason(bundle: dict[str, float], labels: dict[str, str], nodes: list[dict]) -> Optional[str]:
    """None when some alive node can hold ``bundle`` and matches ``labels``; else why not.

    Args:
        bundle: resource name -> amount, as passed to ``ray.util.placement_group``.
        labels: the bundle's label selector (``placement.node_labels``).
        nodes: ``ray.nodes()`` (dicts with ``Alive``, ``Resources``, ``Labels``).

    Returns:
        e.g. ``"no alive node has resource 'decode_node' (custom resources in the cluster: none)"`` or,
        when nodes have every name but none has enough or the labels, each node's first gap.
    """
    alive = [n for n in nodes if n.get("Alive", n.get("alive"))]
    if not alive:
        return "the Ray cluster has no alive node"
    gaps = {n.get("NodeManagerAddress", "?"): _node_gap(bundle, labels, n) for n in alive}
    if any(g is None for g in gaps.values()):
        return None
    missing = [r for r in bundle if not any(r in n.get("Resources", {}) for n in alive)]
    if missing:
        custom = sorted({r for n in alive for r in n.get("Resources", {})
                         if r not in ("CPU", "GPU", "memory", "object_store_memory")
                         and not r.startswith(("node:", "accelerator_type:")) and "_group_" not in r})
        return (f"no alive node has resource {', '.join(repr(r) for r in missing)} "
                f"(custom resources in the cluster: {', '.join(custom) or 'none'}; add one with "
                f"`ray start --resources '{{\"{missing[0]}\": 1}}'` on the node that should run it)")
    missing_labels = [k for k in labels if not any(k in n.get("Labels", {}) for n in alive)]
    if missing_labels:
        return (f"no alive node has label {', '.join(repr(k) for k in missing_labels)} (set one with "
                f"`ray start --labels '{{\"{missing_labels[0]}\": \"...\"}}'`)")
    return "no alive node fits: " + "; ".join(f"{addr}: {gap}" for addr, gap in sorted(gaps.items()))
