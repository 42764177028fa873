"""fp8 e4m3 storage (lib.cache.quant.fp8_encode / fp8_decode): exact rounding to the format, as vLLM stores its fp8 KV cache."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lib.cache.quant import E4M3, FORMS, fp8_decode, fp8_encode

SIGNED = np.concatenate([E4M3, -E4M3])  # (254,) every finite value
SIGNED_CODES = np.concatenate([np.arange(127), np.arange(127) | 0x80]).astype(np.uint8)


def nearest_by_search(x: float) -> float:
    """The e4m3 value nearest to x, ties to the even code, saturating at +-448: by brute force."""
    x = float(np.clip(x, -448, 448))
    d = np.abs(SIGNED - x)
    best = np.flatnonzero(d == d.min())
    even = [i for i in best if SIGNED_CODES[i] % 2 == 0]
    return float(SIGNED[(even or best)[0]])


def test_the_format_has_127_magnitudes_from_0_to_448():
    assert len(E4M3) == 127 and E4M3[0] == 0 and E4M3[-1] == 448 == FORMS["fp8"].qmax
    assert np.all(np.diff(E4M3) > 0)
    assert E4M3[1] == 2.0 ** -9 and E4M3[8] == 2.0 ** -6  # smallest subnormal, smallest normal


def test_every_code_decodes_and_encodes_back_to_itself():
    assert np.array_equal(fp8_encode(fp8_decode(SIGNED_CODES)), SIGNED_CODES)


@given(st.floats(-1000, 1000, allow_nan=False))
def test_encode_rounds_to_the_nearest_value_ties_to_even(x):
    assert fp8_decode(fp8_encode(np.array([x])))[0] == nearest_by_search(x)


def test_midpoints_round_to_the_even_code_and_large_values_saturate():
    mids = (E4M3[1:] + E4M3[:-1]) / 2
    codes = fp8_encode(mids)
    assert np.all(codes % 2 == 0)
    assert np.all(fp8_decode(fp8_encode(np.array([449.0, 1e6, -1e6]))) == [448, 448, -448])


def test_quantize_with_a_scale_keeps_3_mantissa_bits():
    x = np.random.default_rng(0).standard_normal((4, 64, 24)).astype(np.float32)  # (H, T, D)
    scale = np.float32(np.abs(x).max() / FORMS["fp8"].qmax)
    codes = FORMS["fp8"].encode(x, scale)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    back = FORMS["fp8"].decode(codes, scale)
    normal = np.abs(x / scale) >= 2.0 ** -6
    assert np.all(np.abs(back - x)[normal] <= np.abs(x)[normal] * 2.0 ** -4 * (1 + 1e-6))  # half a step of 1/8


def test_matches_ml_dtypes_float8_e4m3fn_bit_for_bit():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    x = rng.standard_normal(100_000) * np.exp(rng.uniform(-12, 6, 100_000))
    x = x[np.abs(x) <= 448]  # ml_dtypes rounds up to 464 to 448 and turns larger values into NaN; vLLM clamps first
    assert np.array_equal(x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), fp8_encode(x))


def test_above_448_both_round_to_448_up_to_464_then_ml_dtypes_turns_nan_and_this_engine_saturates():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([448.5, 460.0, 463.9, 464.0, 464.1, 1000.0])
    theirs = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ours = fp8_decode(fp8_encode(x))
    assert np.all(theirs[:4] == 448) and np.all(np.isnan(theirs[4:]))  # 464 is halfway to the next step: ties to even
    assert np.all(ours == 448)
