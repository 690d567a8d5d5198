"""Reduction kernels and 16-bit float conversions against NumPy and ml_dtypes."""

import numpy as np
import pytest

from ferro._core.reduce import divide, has_kernel, reduce_into
from ferro.types import dtype_by_name

# The references overflow and produce NaN on purpose (inf - inf, 65520 -> inf).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OPS = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "BAND": 4, "BOR": 5, "BXOR": 6}
NUMPY_OPS = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
             "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}


def combine(a, b, op):
    dtype = dtype_by_name(a.dtype.name)
    out = a.copy()
    view = (lambda x: x.view(np.uint16)) if a.dtype.name == "bfloat16" else (lambda x: x)
    reduce_into(view(out), view(b), dtype.code, OPS[op], dtype.itemsize)
    return out


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"])
@pytest.mark.parametrize("op", list(OPS))
def test_integer_kernels_match_numpy_including_wraparound(dtype, op):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    a = rng.integers(info.min, info.max, 10_001, dtype=dtype, endpoint=True)
    b = rng.integers(info.min, info.max, 10_001, dtype=dtype, endpoint=True)
    np.testing.assert_array_equal(combine(a, b, op), NUMPY_OPS[op](a, b))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX"])
def test_float_kernels_match_numpy_bit_for_bit(dtype, op):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(10_001).astype(dtype)
    b = rng.standard_normal(10_001).astype(dtype)
    a[:4] = [np.nan, 1.0, np.inf, -0.0]
    b[:4] = [1.0, np.nan, -np.inf, 0.0]
    expected = NUMPY_OPS[op](a, b)
    got = combine(a, b, op)
    assert got[4:].tobytes() == expected[4:].tobytes()  # the bits, not values within a tolerance
    assert np.isnan(got[0]) and np.isnan(got[1])  # NaN propagates from either side
    assert got[2].tobytes() == expected[2].tobytes()  # infinities combine as NumPy's do


@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_min_max_are_symmetric_for_signed_zeros(op):
    pos, neg = np.array([0.0]), np.array([-0.0])
    assert combine(pos, neg, op).tobytes() == combine(neg, pos, op).tobytes()


def test_bitwise_ops_do_not_apply_to_floats():
    assert not has_kernel(dtype_by_name("float32").code, OPS["BAND"])
    with pytest.raises(ValueError):
        reduce_into(np.zeros(2), np.zeros(2), dtype_by_name("float64").code, OPS["BXOR"], 8)


def test_float16_sum_rounds_like_numpy_for_every_pair_class():
    # Every float16 bit pattern against a fixed set of partners, through float32.
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    for partner in [0.0, 1.0, -2.5, 6e-8, 65504.0, 1e-4]:
        other = np.full_like(every, partner)
        expected = (every.astype(np.float32) + other.astype(np.float32)).astype(np.float16)
        got = combine(every, other, "SUM")
        finite = ~np.isnan(expected)
        assert np.array_equal(got[finite].view(np.uint16), expected[finite].view(np.uint16))
        assert np.isnan(got[~finite]).all()


def test_float16_from_float32_rounds_to_nearest_even_like_numpy():
    rng = np.random.default_rng(2)
    values = np.concatenate([rng.standard_normal(200_000) * 10.0 ** rng.integers(-9, 6, 200_000),
                             [65519.0, 65520.0, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8]]).astype(np.float32)
    # SUM with zero makes the kernel round a float32 result to float16: compare via a float16 pair sum.
    halves = values.astype(np.float16)
    lows = (values - halves.astype(np.float32)).astype(np.float16)
    expected = (halves.astype(np.float32) + lows.astype(np.float32)).astype(np.float16)
    got = combine(halves, lows, "SUM")
    finite = ~np.isnan(expected)
    assert np.array_equal(got[finite].view(np.uint16), expected[finite].view(np.uint16))


def test_bfloat16_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 reference")
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    a = rng.standard_normal(100_000).astype(bf16)
    b = (rng.standard_normal(100_000) * 1e-2).astype(bf16)
    expected = (a.astype(np.float32) + b.astype(np.float32)).astype(bf16)
    assert np.array_equal(combine(a, b, "SUM").view(np.uint16), expected.view(np.uint16))


def test_divide_is_for_floats_only():
    x = np.array([2.0, 4.0], np.float32)
    divide(x, dtype_by_name("float32").code, 2.0, 4)
    assert x.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError):
        divide(np.zeros(2, np.int32), dtype_by_name("int32").code, 2.0, 4)
