"""Hypothesis cases shared by the CPU and GPU tests of mixed2bit's tiled layout."""
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strategies import float_inputs

SENS_VALUES = [0.0, -0.0, 1e-40, 1e-3, 0.5, 1.0, 3.0, 1e10, 3e38]


@st.composite
def tiled_cases(draw, dtypes=("float32", "float16", "bfloat16")):
    """(input, params dict, sensitivity float32 [K] or None). Rows of up to 600 groups: several
    tiles of 256, the last one shorter."""
    gs = draw(st.sampled_from([16, 32]))
    max_blocks = draw(st.sampled_from([5, 40, 600]))
    inp = draw(float_inputs(block=gs, min_rows=1, max_rows=4, min_blocks=1, max_blocks=max_blocks, dtypes=dtypes))
    K = inp.x32.shape[1]
    params = {
        "group_size": gs,
        "ratio_4bit": draw(st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0, 1)),
        "scale_block": draw(st.sampled_from([1, 2, 16, 64, 256])),
    }
    sens = None
    if draw(st.booleans()):
        sens = draw(hnp.arrays(np.float32, (K,), elements=st.sampled_from(SENS_VALUES) | st.floats(0, 100, width=32)))
    return inp, params, sens
