"""The compact stream's alphabet and coder constants, shared by `compact` and its compiled `kernels`.

Here, not in either of them: `kernels` imports numba (which `compact` must not load at import time), and
`compact` imports `kernels` only inside the functions that run them.
"""

MAX_CLASSES = 4
Q_SYMBOLS = 32  # Rice quotients 0..30, 31 escapes to a raw 32-bit quotient
V_SYMBOLS = 16  # zigzag value steps 1..15, 16 escapes to the raw 16-bit new pattern
MAX_RICE = 23  # remainders stay well inside the 32-bit bit writer (and v1's uniform model, < 2^24)
CLASS_COST_BITS = 48.0  # rough header + model cost of one more class, for choosing K
ANS_SCALE = 14  # the quantized frequencies of every model sum to 2^14
