"""pd.cluster.placement_check: the launcher names what a worker's bundle lacks instead of waiting silently."""

from pd.cluster.placement_check import unplaceable_reason


def node(addr, resources, labels=None, alive=True):
    return {"NodeManagerAddress": addr, "Alive": alive, "Labels": {"ray.io/node-id": addr, **(labels or {})},
            "Resources": {"CPU": 8.0, "memory": 1e9, f"node:{addr}": 1.0, **resources}}


HEAD = node("10.0.0.1", {"GPU": 8.0, "prefill_node": 1.0, "bundle_group_0_abc": 1000.0}, {"zone": "a"})


def test_fitting_bundle_has_no_reason():
    assert unplaceable_reason({"GPU": 4}, {}, [HEAD]) is None
    assert unplaceable_reason({"GPU": 8, "prefill_node": 0.01}, {"zone": "a"}, [HEAD]) is None
    # any one node that fits is enough
    nodes = [HEAD, node("10.0.0.2", {"GPU": 2.0, "decode_node": 1.0})]
    assert unplaceable_reason({"GPU": 2, "decode_node": 1}, {}, nodes) is None


def test_missing_custom_resource_is_named_without_internal_keys():
    why = unplaceable_reason({"GPU": 1, "decode_node": 0.01}, {}, [HEAD])
    assert why.startswith("no alive node has resource 'decode_node'")
    assert "prefill_node" in why and "bundle_group" not in why and "node:10.0.0.1" not in why
    assert "ray start --resources '{\"decode_node\": 1}'" in why


def test_dead_nodes_do_not_count():
    dead = node("10.0.0.2", {"GPU": 8.0, "decode_node": 1.0}, alive=False)
    assert "'decode_node'" in unplaceable_reason({"GPU": 1, "decode_node": 1}, {}, [HEAD, dead])
    assert unplaceable_reason({"GPU": 1}, {}, [dead]) == "the Ray cluster has no alive node"


def test_too_many_gpus_on_one_node_names_each_gap():
    why = unplaceable_reason({"GPU": 16}, {}, [HEAD, node("10.0.0.2", {"GPU": 4.0})])
    assert why == "no alive node fits: 10.0.0.1: GPU 8 < 16; 10.0.0.2: GPU 4 < 16"


def test_label_selectors_follow_ray_syntax():
    assert "no alive node has label 'rack'" in unplaceable_reason({"GPU": 1}, {"rack": "r1"}, [HEAD])
    assert unplaceable_reason({"GPU": 1}, {"zone": "b"}, [HEAD]) == \
        "no alive node fits: 10.0.0.1: label zone='a' does not match 'b'"
    assert unplaceable_reason({"GPU": 1}, {"zone": "!b"}, [HEAD]) is None
    assert unplaceable_reason({"GPU": 1}, {"zone": "in(b, a)"}, [HEAD]) is None
    assert unplaceable_reason({"GPU": 1}, {"zone": "!in(a,b)"}, [HEAD]) is not None
