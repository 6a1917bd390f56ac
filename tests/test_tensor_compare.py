"""tests/tensor_compare.py, the comparison the kernel tests, the model-level tests and the benchmarks share."""
import pytest
import torch

from tests.tensor_compare import assert_close, error_ratio, tolerance


def test_within_tolerance_passes_and_mag_scales_atol():
    e = torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64)
    assert_close(e.float() + 1e-6, e)                                   # float32 default: rtol 1e-5, atol 2e-6
    with pytest.raises(AssertionError):
        assert_close(e.float() + 1e-3, e)
    assert_close(e.float() + 1e-3, e, torch.full((3,), 1000.0))        # atol 2e-6 * mag = 2e-3
    assert error_ratio(e.float() + 1e-3, e, torch.full((3,), 1000.0), rtol=0.0, atol=2e-6) == pytest.approx(0.5, rel=1e-3)


def test_failure_message_names_the_elements():
    with pytest.raises(AssertionError) as info:
        assert_close(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 2.0], [3.5, 4.0]]), what="chunk 1")
    msg = str(info.value)
    assert msg.startswith("chunk 1: 1 of 4 elements mismatch (rtol 1e-05, atol 2e-06)")
    assert "(1, 0): got 3, expected 3.5" in msg


def test_shape_dtype_and_nonfinite_are_refused():
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(AssertionError, match="dtype torch.float16, expected torch.bfloat16"):
        assert_close(torch.zeros(2, dtype=torch.float16), torch.zeros(2), dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="1 of 2 elements are not finite"):
        assert_close(torch.tensor([0.0, float("nan")]), torch.zeros(2))
    assert error_ratio(torch.tensor([float("inf")]), torch.zeros(1), rtol=1.0, atol=1.0) == float("inf")


def test_per_dtype_tolerances():
    assert tolerance(torch.bfloat16) == (1.6e-2, 1e-6)
    assert tolerance(torch.float16)[0] < tolerance(torch.bfloat16)[0]
    with pytest.raises(ValueError, match="no default tolerance"):
        tolerance(torch.int32)
