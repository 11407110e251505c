"""The launchers' plain-Python cdiv / next_power_of_2 give triton's results (CPU only: no kernel runs)."""
import triton

from tritune import kernels as K

LARGE = [2**k + d for k in range(10, 65) for d in (-1, 0, 1) if 2**k + d <= 2**64]


def test_next_power_of_2_matches_triton():
    for n in [*range(-40, 5001), *LARGE]:
        assert K.next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    for y in (1, 2, 3, 7, 16, 64, 128, 132, 256, 1000):
        for x in [*range(-300, 5001), *LARGE]:
            assert K.cdiv(x, y) == triton.cdiv(x, y), (x, y)
    for x, y in ((2**62 + 5, 2**31 - 1), (10**18, 3), (5, 2**40)):
        assert K.cdiv(x, y) == triton.cdiv(x, y)
