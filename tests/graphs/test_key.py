"""Graph keys: equal for calls one graph can serve, different otherwise; pure Python."""

import torch

from tendril.graphs.key import GraphKey, TensorSpec, Unkeyable, flatten_call, key_for, key_of


def test_same_shapes_dtypes_devices_and_constants_give_equal_keys():
    a = key_for(torch.zeros(2, 3), scale=2, use_cache=False)
    b = key_for(torch.ones(2, 3), scale=2, use_cache=False)
    assert a == b and hash(a) == hash(b)


def test_each_part_of_the_key_matters():
    base = key_for(torch.zeros(2, 3), scale=2)
    assert base != key_for(torch.zeros(2, 4), scale=2)
    assert base != key_for(torch.zeros(2, 3, dtype=torch.float16), scale=2)
    assert base != key_for(torch.zeros(2, 3), scale=3)
    assert base != key_for(torch.zeros(2, 3), 2)  # positional vs keyword
    assert base != key_for(torch.zeros(2, 3), other=2)


def test_constants_of_different_types_with_equal_values_differ():
    assert key_for(1) != key_for(1.0)
    assert key_for(1) != key_for(True)


def test_strides_are_not_part_of_the_key():
    x = torch.zeros(3, 2).t()
    assert key_for(x) == key_for(torch.zeros(2, 3))


def test_nested_arguments_flatten_through_pytree_and_round_trip():
    args = ([torch.zeros(1), {"k": torch.ones(2)}], 4)
    flat = flatten_call(args, {"flag": True})
    key = key_of(flat)
    assert isinstance(key, GraphKey)
    assert [spec.shape for spec in key.tensors] == [(1,), (2,)]
    rebuilt_args, rebuilt_kwargs = flat.unflatten(list(flat.leaves))
    assert rebuilt_kwargs == {"flag": True}
    assert rebuilt_args[1] == 4 and torch.equal(rebuilt_args[0][1]["k"], torch.ones(2))


def test_flat_calls_round_trip_and_report_tensor_positions():
    x, y = torch.zeros(1), torch.ones(1)
    flat = flatten_call((x, 3), {"mask": y})
    assert flat.tensor_indices() == [0, 2]
    args, kwargs = flat.unflatten(flat.leaves)
    assert args[0] is x and args[1] == 3 and kwargs["mask"] is y


def test_unhashable_argument_has_no_key_and_says_why():
    key = key_for(torch.zeros(1), object.__new__(type("Unhashable", (), {"__hash__": None})))
    assert isinstance(key, Unkeyable)
    assert "not hashable" in key.reason


def test_key_size_orders_capture_and_prints_readably():
    small, large = key_for(torch.zeros(4)), key_for(torch.zeros(8))
    assert isinstance(small, GraphKey) and isinstance(large, GraphKey)
    assert large.nbytes == 32 > small.nbytes
    assert "float32[8]@cpu" in str(large)
    assert TensorSpec.of(torch.zeros(2, 5, dtype=torch.float16)).nbytes == 20
