"""Byte counts as people read them, the same everywhere."""

import pytest

from appkit.units import format_bytes


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (999.6, "1.0 kB"),  # rounding never shows "1000 B" or "1000.0 kB"
        (2048, "2.0 kB"),
        (999_960, "1.0 MB"),
        (45.6e6, "45.6 MB"),
        (3.2e9, "3.2 GB"),
        (1.5e15, "1500.0 TB"),
        (-2048, "-2.0 kB"),
        (None, "–"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
