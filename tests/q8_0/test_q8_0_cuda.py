"""q8_0 on the GPU: bytes equal the CPU and the reference; dequantize equal; streams; layouts
(the cases shared with the other blockwise formats, tests/blockwise_cuda_cases.py)."""
from blockwise_cuda_cases import add_blockwise_gpu_tests
from conftest import requires_cuda
from qformats import q8_0

pytestmark = requires_cuda
add_blockwise_gpu_tests(globals(), q8_0, q8_0.quantize_q8_0, q8_0.dequantize_q8_0)
