"""kimi/params.py's tree utilities: `unflatten` inverts `tree_items`."""

import kimi
from kimi.params import tree_items, unflatten

from helpers import small_cfg


def test_unflatten_inverts_tree_items():
    """The same paths in the same order, the very same leaves, layers as a list."""
    params = kimi.init_params(small_cfg(), seed=0)
    back = unflatten(dict(tree_items(params)))
    got, want = list(tree_items(back)), list(tree_items(params))
    assert [p for p, _ in got] == [p for p, _ in want] and all(a is b for (_, a), (_, b) in zip(got, want))
    assert isinstance(back["model"]["layers"], list)
    assert unflatten({"a.b.0.c": 1, "a.b.1.c": 2, "d": 3}) == {"a": {"b": [{"c": 1}, {"c": 2}]}, "d": 3}
