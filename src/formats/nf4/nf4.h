// nf4 pack spec: bitsandbytes' 4-bit NormalFloat ("NF4", QLoRA, arXiv:2305.14314), byte-compatible
// with bitsandbytes 0.50 `bitsandbytes.functional.quantize_4bit(A, blocksize, quant_type="nf4",
// compress_statistics=...)` on the CPU (its "default" torch backend, backends/default/ops.py, for the
// 4-bit part; csrc/cpu_ops.cpp `quantize_cpu_impl` for the 8-bit double quantization of absmax).
//
// Layout: the input is flattened (row-major) to n values and cut into ceil(n / blocksize) blocks of
// `blocksize` values (32..4096, a power of two); the last block may be partial. Three arrays:
//
//   packed  uint8  [ceil(n/2)]   byte j = code[2j] << 4 | code[2j+1]
//                                 (even element in the HIGH nibble; for odd n the low nibble of the
//                                 last byte is the padding code 7, the code of 0.0)
//   absmax  float32[n_blocks]    per-block scale (plain), or, with compress_statistics:
//   absmax  uint8  [n_blocks]    8-bit codes into kDynamicMap of (absmax - offset)
//   absmax2 float32[ceil(n_blocks/256)]  per-256-block scale of (absmax - offset)
//   offset  float32[1]           mean of the float32 absmax
//
//        byte 0                byte 1
//   +--------+--------+  +--------+--------+
//   | x[0]   | x[1]   |  | x[2]   | x[3]   |  ...   (bits 7..4 | bits 3..0)
//   +--------+--------+  +--------+--------+
//
// Quantize one block b = x[s .. e) (inputs converted exactly to float32 first; float32 arithmetic,
// every operation rounded separately; this is what bitsandbytes computes for float32, float16 and
// bfloat16 alike: its CPU path starts with A.reshape(-1).float()):
//   a       = max |x| over the block                       (-0 counts as 0)
//   full block:    stored absmax = a;  s_i = x_i * fl(1 / max(a, TINY))    (reciprocal, then multiply)
//   partial block: stored absmax = max(a, TINY);  s_i = x_i / max(a, TINY) (a true division!)
//   code_i  = number of the 15 midpoints m_j with s_i > m_j   (strict: a tie goes to the LOWER code)
// with TINY = fl32(1e-38) (a subnormal) and m_j = fl32(kCode[j] + kCode[j+1]) / 2.
// Decode: x' = kCode[code] * absmax (one float32 multiply), for every block.
//
// bitsandbytes details that differ from a plain reading of "x * (1/absmax)", all reproduced here:
// * The partial last block uses x / absmax, not x * (1/absmax) (the two differ in the last bit and
//   so, rarely, in the code), and its stored absmax is clamped to TINY: an all-zero partial block
//   stores absmax = 1e-38 (bits 0x006CE3EE), a full all-zero block stores 0. Both store code 7.
// * A full block whose absmax is below TINY (subnormal inputs) still stores the true absmax but is
//   scaled by 1/TINY, so its codes are those of x / 1e-38 (pulled toward 0); see the error bound.
// * bitsandbytes clamps s to [-1, 1]; that never changes a code (every midpoint is inside (-1, 1)),
//   so it is left out.
//
// Double quantization (compress_statistics=True; bitsandbytes quantize_blockwise(absmax - offset,
// blocksize=256) with the signed dynamic 8-bit map, create_dynamic_map(), on its CPU kernel):
//   offset = fl32(sum(absmax) / fl32(n_blocks)), the sum in torch's CPU float32 order (torch
//            Tensor.mean on one thread: see mean_torch_order in nf4_cpu.cpp); NaN (0xFFC00000)
//            when there are no blocks.
//   d_i    = fl32(absmax_i - offset)
//   per 256-block of d: a2 = max |d| (stored as absmax2); if a2 == 0 every code is 0; else
//            v = d * fl(1 / a2), clamped to [-1, 1] (a NaN v, 0 * inf when 1/a2 overflows, gives 0),
//            t = idx of the 65536-cell table: trunc(fl(fl(fl(v + 1) * 0.5) * 65535) + 0.5),
//            code = number of map midpoints fl32(0.5 * (D[k] + D[k+1])) strictly below the cell
//            value fl32(-1 + fl32(2 * t) / 65535)       (bitsandbytes' build_quantize_lut)
//   decoded absmax = fl32(fl32(D[code] * absmax2) + offset)
// The table makes the 8-bit code "nearest to the table cell", not always nearest to v; that is
// what bitsandbytes 0.50 stores, so it is what we store. One visible consequence: d = 0 (v = 0)
// falls in cell 32768, whose value is +1/65535, and is stored as code 131 (2.125e-5 * absmax2),
// not as the map's exact 0 (code 127).
//
// Float16 / bfloat16 inputs: bitsandbytes converts them to float32 (exact) before anything else,
// so the codes and absmax equal those of the float32 input with the same values. Its
// dequantize_4bit to fp16/bf16 computes the float32 product and rounds it once (nearest even);
// the dequantize kernels do the same, writing the output type directly (from_f32).
//
// CUDA (nf4_cuda.cu) runs the same per-value rules (the QF_HOST_DEVICE functions below; the tables
// are read through accessors that see __constant__ copies on the device), so GPU bytes equal CPU
// bytes: absmax is a max of non-negative values (order-free), the 4-bit code comes from a
// 33-cell table and one comparison, equal to code_of for every float (code_of_cells, checked over
// all 2^32 floats by tests/nf4/code_cells_check.cpp), and the offset is summed in the same torch
// order by one CTA (the cascade helpers at the end of this file).
//
// Caveats of bitsandbytes 0.50 itself (the tests pin them down):
// * torch splits a float32 sum of >= 32768 values across its intra-op threads, so for more than
//   32767 blocks bitsandbytes' offset may depend on torch.get_num_threads(); ours is the
//   one-thread value.
// * Its AVX-512 CPU dequantize_4bit indexes absmax per row (absmax[row * (K / blocksize) + ...]),
//   which is wrong for 2-D shapes whose rows are not whole blocks; its decode of the flattened
//   tensor is right and equals ours.
// * When the float32 sum of absmax overflows (|x| ~ 1e38), it stores offset = inf and decodes
//   NaN. The kernels here reproduce those bytes; qformats.nf4.quantize refuses such input.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/fp16.h"

namespace qf::nf4 {

constexpr int kMinBlocksize = 32;
constexpr int kMaxBlocksize = 4096;
constexpr int kDoubleQuantBlock = 256;  // blocksize of the second-level (absmax) quantization
constexpr int kPadCode = 7;             // code of 0.0: odd-length padding

// The 16 NF4 values, bitsandbytes get_4bit_type("nf4") (= create_normal_map(0.9677083), the
// normal-quantile levels of QLoRA, normalized to [-1, 1]) as exact float32 hex literals.
// The value tables keep their columns:
// clang-format off
#define QF_NF4_CODE_VALUES \
    -0x1p+0f,        -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f, \
    -0x1.23449ap-2f, -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0.0f, \
    0x1.45f5fep-4f,  0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f, \
    0x1.c3497p-2f,   0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f,
constexpr float kCode[16] = {QF_NF4_CODE_VALUES};
// Decision boundaries: (kCode[j] + kCode[j+1]) / 2 in float32 (bitsandbytes computes them the same
// way, _get_4bit_quantize_bounds). Decimal: -0.8480964, -0.6106329, -0.45999527, -0.33967942,
// -0.2346074, -0.13791174, -0.045525018, 0.03979015, 0.12025525, 0.20352125, 0.29201376,
// 0.38931254, 0.50166345, 0.6427869, 0.8614784.
#define QF_NF4_MIDPOINT_VALUES \
    -0x1.b239bp-1f,  -0x1.38a4ep-1f,  -0x1.d709p-2f,   -0x1.5bd4ecp-2f,  -0x1.e079d8p-3f, \
    -0x1.1a7178p-3f, -0x1.74f0e2p-5f, 0x1.45f5fep-5f,  0x1.ec90c4p-4f,   0x1.a0cfcp-3f, \
    0x1.2b05a8p-2f,  0x1.8ea7f2p-2f,  0x1.00da08p-1f,  0x1.491b5ep-1f,   0x1.b913b4p-1f,
constexpr float kMidpoint[15] = {QF_NF4_MIDPOINT_VALUES};
// fl32(1e-38): bitsandbytes' absmax.clamp(min=1e-38) (a subnormal, bits 0x006CE3EE).
constexpr float kTiny = 0x1.b38fb8p-127f;

// The signed dynamic 8-bit map, bitsandbytes create_dynamic_map(signed=True) (8-bit Approximations
// for Parallelism in Deep Learning, arXiv:1511.04561), float32, sorted ascending. Entry 0 is
// -0.99296874 (bitsandbytes 0.50 no longer overwrites it with -1 on the CPU).
#define QF_NF4_DYNAMIC_MAP_VALUES \
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f, -0x1.df999ap-1f, -0x1.d86666p-1f, \
    -0x1.d13334p-1f, -0x1.cap-1f, -0x1.c2ccccp-1f, -0x1.bb999ap-1f, -0x1.b46666p-1f, -0x1.ad3334p-1f, \
    -0x1.a6p-1f, -0x1.9eccccp-1f, -0x1.97999ap-1f, -0x1.906666p-1f, -0x1.893334p-1f, -0x1.82p-1f, \
    -0x1.7accccp-1f, -0x1.73999ap-1f, -0x1.6c6668p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f, \
    -0x1.4f999ap-1f, -0x1.486668p-1f, -0x1.413334p-1f, -0x1.3ap-1f, -0x1.32ccccp-1f, -0x1.2b999ap-1f, \
    -0x1.246668p-1f, -0x1.1d3334p-1f, -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.079998p-1f, -0x1.006666p-1f, \
    -0x1.f26664p-2f, -0x1.e4p-2f, -0x1.d59998p-2f, -0x1.c73334p-2f, -0x1.b8ccccp-2f, -0x1.aa6666p-2f, \
    -0x1.9cp-2f, -0x1.8d9998p-2f, -0x1.7f3334p-2f, -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f, \
    -0x1.459998p-2f, -0x1.373334p-2f, -0x1.28ccccp-2f, -0x1.1a6668p-2f, -0x1.0cp-2f, -0x1.fb3332p-3f, \
    -0x1.de6666p-3f, -0x1.c1999ap-3f, -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f, \
    -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f, -0x1.b66668p-4f, -0x1.93d70ap-4f, -0x1.8851eep-4f, \
    -0x1.7ccccep-4f, -0x1.7147aep-4f, -0x1.65c29p-4f, -0x1.5a3d7p-4f, -0x1.4eb854p-4f, -0x1.433334p-4f, \
    -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f, -0x1.151ebap-4f, -0x1.09999ap-4f, -0x1.fc28f6p-5f, \
    -0x1.e51ebap-5f, -0x1.ce147ap-5f, -0x1.b70a3ep-5f, -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb86p-5f, \
    -0x1.5ae146p-5f, -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c29p-5f, -0x1.fd70a4p-6f, -0x1.cf5c2ap-6f, \
    -0x1.a147aep-6f, -0x1.733334p-6f, -0x1.451ebap-6f, -0x1.170a3ep-6f, -0x1.d1eb86p-7f, -0x1.75c29p-7f, \
    -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f, -0x1.e978d4p-8f, -0x1.c49ba6p-8f, \
    -0x1.9fbe76p-8f, -0x1.7ae148p-8f, -0x1.56041ap-8f, -0x1.3126e8p-8f, -0x1.0c49bap-8f, -0x1.ced914p-9f, \
    -0x1.851eb8p-9f, -0x1.3b645ap-9f, -0x1.e353f8p-10f, -0x1.4fdf3ap-10f, -0x1.eecbfep-11f, -0x1.b3d07cp-11f, \
    -0x1.78d5p-11f, -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f, \
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f, -0x1.040bfep-17f, -0x1.b43528p-19f, \
    -0x1.27476ep-21f, 0x0.0p+0f, 0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f, 0x1.64840cp-16f, \
    0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f, 0x1.19ce0ap-12f, 0x1.8fc506p-12f, \
    0x1.02de02p-11f, 0x1.3dd982p-11f, 0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f, 0x1.4fdf3ap-10f, \
    0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f, 0x1.0c49bap-8f, 0x1.3126e8p-8f, \
    0x1.56041ap-8f, 0x1.7ae148p-8f, 0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, 0x1.072b02p-7f, \
    0x1.19999ap-7f, 0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f, 0x1.d1eb86p-7f, 0x1.170a3ep-6f, \
    0x1.451ebap-6f, 0x1.733334p-6f, 0x1.a147aep-6f, 0x1.cf5c2ap-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f, \
    0x1.2ccccep-5f, 0x1.43d70ap-5f, 0x1.5ae146p-5f, 0x1.71eb86p-5f, 0x1.88f5c2p-5f, 0x1.ap-5f, \
    0x1.b70a3ep-5f, 0x1.ce147ap-5f, 0x1.e51ebap-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151ebap-4f, \
    0x1.20a3d6p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f, 0x1.4eb854p-4f, 0x1.5a3d7p-4f, \
    0x1.65c29p-4f, 0x1.7147aep-4f, 0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f, 0x1.b66668p-4f, \
    0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f, 0x1.6b3334p-3f, 0x1.88p-3f, \
    0x1.a4ccccp-3f, 0x1.c1999ap-3f, 0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f, 0x1.1a6668p-2f, \
    0x1.28ccccp-2f, 0x1.373334p-2f, 0x1.459998p-2f, 0x1.54p-2f, 0x1.626666p-2f, 0x1.70ccccp-2f, \
    0x1.7f3334p-2f, 0x1.8d9998p-2f, 0x1.9cp-2f, 0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f, \
    0x1.d59998p-2f, 0x1.e4p-2f, 0x1.f26664p-2f, 0x1.006666p-1f, 0x1.079998p-1f, 0x1.0eccccp-1f, \
    0x1.16p-1f, 0x1.1d3334p-1f, 0x1.246668p-1f, 0x1.2b999ap-1f, 0x1.32ccccp-1f, 0x1.3ap-1f, \
    0x1.413334p-1f, 0x1.486668p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f, 0x1.5ep-1f, 0x1.653334p-1f, \
    0x1.6c6668p-1f, 0x1.73999ap-1f, 0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f, \
    0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f, 0x1.b46666p-1f, 0x1.bb999ap-1f, \
    0x1.c2ccccp-1f, 0x1.cap-1f, 0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f, \
    0x1.eep-1f, 0x1.f53334p-1f, 0x1.fc6666p-1f, 0x1p+0f,
constexpr float kDynamicMap[256] = {QF_NF4_DYNAMIC_MAP_VALUES};
// clang-format on
constexpr int kDynamicLutCells = 65536;  // bitsandbytes' kLUTSize: cells of [-1, 1] in its table

// The tables in device code: nvcc cannot read a host constexpr array with a run-time index there,
// so CUDA translation units get __constant__ copies built from the same literal lists, and the
// rules below read every table through these accessors (host: the constexpr arrays; device: the
// copies). Bit-identical by construction.
#if defined(__CUDACC__)
static __constant__ float kCodeDev[16] = {QF_NF4_CODE_VALUES};
static __constant__ float kMidpointDev[15] = {QF_NF4_MIDPOINT_VALUES};
static __constant__ float kDynamicMapDev[256] = {QF_NF4_DYNAMIC_MAP_VALUES};
#endif

QF_HOST_DEVICE float code_value(int c) {
#if defined(__CUDA_ARCH__)
  return kCodeDev[c];
#else
  return kCode[c];
#endif
}
QF_HOST_DEVICE float midpoint(int j) {
#if defined(__CUDA_ARCH__)
  return kMidpointDev[j];
#else
  return kMidpoint[j];
#endif
}
QF_HOST_DEVICE float dynamic_map_value(int k) {
#if defined(__CUDA_ARCH__)
  return kDynamicMapDev[k];
#else
  return kDynamicMap[k];
#endif
}

// --- the 4-bit rule ------------------------------------------------------------------------------

// Code of a scaled value s: the number of midpoints strictly below s (ties go to the lower code).
// Summing 15 comparisons instead of a binary search keeps it branch-free (and vectorizable).
QF_HOST_DEVICE uint8_t code_of(float s) {
  int q = 0;
  for (int j = 0; j < 15; ++j) q += s > midpoint(j) ? 1 : 0;
  return static_cast<uint8_t>(q);
}

// The same count by one table lookup and one comparison (the CUDA quantizer's form; 8 bytes of
// shared memory per cell). cell_of(s) puts s into one of kCodeCells cells: s clamped to [-1, 1]
// (a NaN to -1), then the integer nearest 16 s + 16, read from the bits of fl(16 s + 1.5 * 2^23 +
// 16) (one fused multiply-add). Each step is monotone, so cell_of is non-decreasing in s (NaN in
// cell 0); cells are 1/16 wide in s and consecutive midpoints at least 0.08 apart, so no cell
// holds two midpoints. With, for cell i, base = the number of midpoints in cells below i and mid
// = the midpoint in cell i (+inf if none), code_of(s) = base + (s > mid) for s in cell i: the
// midpoints of lower cells are below s, those of higher cells above it, and the one in its cell
// is compared. The clamp changes no cell where |s| <= 1 + 2^-20 (fl(16 s + ...) rounds to the
// same integer), which holds for every scaled value of finite input (|x * fl(1 / a)| <= 1 +
// 2^-23 for |x| <= a), so the GPU leaves it out there. Both facts are checked for all 2^32
// float32 bit patterns by tests/nf4/code_cells_check.cpp (with the premise of the argument: no
// cell holds two midpoints).
constexpr int kCodeCells = 33;
constexpr float kCellMagic = 12582928.0f;         // 1.5 * 2^23 + 16
constexpr uint32_t kCellMagicBase = 0x4B400000u;  // bits(1.5 * 2^23): bits(w) - this = the cell
struct CodeCell {
  float mid;  // the midpoint inside the cell, +inf if none
  int base;   // the number of midpoints in lower cells
};

// The cell of s without the clamp: valid for |s| <= 1 + 2^-20 only (see above).
QF_HOST_DEVICE int cell_of_unclamped(float s) {
  return static_cast<int>(f32_bits(fmaf(s, 16.0f, kCellMagic)) - kCellMagicBase);
}
QF_HOST_DEVICE int cell_of(float s) {
  const float c = s > 1.0f ? 1.0f : (s >= -1.0f ? s : -1.0f);  // NaN -> -1
  return cell_of_unclamped(c);                                 // 0 .. 32
}

QF_HOST_DEVICE CodeCell code_cell(int i) {
  CodeCell c{INFINITY, 0};
  for (int j = 0; j < 15; ++j) {
    const int cj = cell_of(midpoint(j));
    if (cj < i) ++c.base;
    else if (cj == i) c.mid = midpoint(j);
  }
  return c;
}

// code_of(s) from the kCodeCells cells code_cell(0 .. kCodeCells - 1).
QF_HOST_DEVICE uint32_t code_of_cells(float s, const CodeCell* cells) {
  const CodeCell c = cells[cell_of(s)];
  return static_cast<uint32_t>(c.base + (s > c.mid ? 1 : 0));
}

// One step of the block absmax: a = max(a, |v|) as bitsandbytes' torch code gives it. Starting
// from a = +0, a stays +0 or positive (a -0 input never wins: -0 > +0 is false), and a NaN v is
// skipped. So the result is the maximum of a set of non-negative, non-NaN values: the same in any
// order of evaluation, which the CUDA kernels rely on (they combine partial maxima of +0-started
// runs with fmaxf, which agrees with this step on such operands).
QF_HOST_DEVICE float abs_max_step(float a, float v) {
  const float av = v < 0 ? -v : v;  // |v| (-0 stays -0, which never beats a >= +0)
  return av > a ? av : a;
}

// The divisor of a block with absmax a: absmax.clamp(min=1e-38).
QF_HOST_DEVICE float block_den(float a) { return a > kTiny ? a : kTiny; }
// A full block stores its true absmax (0 for an all-zero block), a partial one the clamped one.
QF_HOST_DEVICE float stored_absmax(float a, bool full) { return full ? a : block_den(a); }
// A full block scales by the reciprocal (one float32 division per block, then one multiply per
// value); the partial last block divides every value (see the header comment).
QF_HOST_DEVICE float block_recip(float a) { return 1.0f / block_den(a); }

// Quantize one block x[0..len), len = blocksize for a full block, fewer for the last one.
// Writes the block's absmax and its codes, one per byte, into q[0..len).
template <class T>
QF_HOST_DEVICE float quantize_block(const T* x, int64_t len, bool full, uint8_t* q) {
  float a = 0.0f;
  for (int64_t i = 0; i < len; ++i) a = abs_max_step(a, to_f32(x[i]));
  if (full) {
    const float r = block_recip(a);
    for (int64_t i = 0; i < len; ++i) q[i] = code_of(to_f32(x[i]) * r);
  } else {
    const float den = block_den(a);
    for (int64_t i = 0; i < len; ++i) q[i] = code_of(to_f32(x[i]) / den);  // true division
  }
  return stored_absmax(a, full);
}

QF_HOST_DEVICE float dequantize_value(uint8_t code, float absmax) { return code_value(code & 15) * absmax; }

// --- the 8-bit rule of the double quantization -----------------------------------------------------

// Code of v = d * (1 / absmax2) in kDynamicMap, as bitsandbytes' 65536-cell lookup table.
QF_HOST_DEVICE uint8_t dynamic_code_of(float v) {
  if (!(v == v)) return 0;  // NaN (0 * inf): bitsandbytes' table lookup yields 0 on x86
  v = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
  constexpr float kLast = static_cast<float>(kDynamicLutCells - 1);  // 65535
  const float t = ((v + 1.0f) * 0.5f) * kLast + 0.5f;                // four separately rounded operations
  const int cell = static_cast<int>(t);                              // truncation; t in [0.5, 65535.5]
  // The cell's value, as the table was built: -1 + (2 * cell) / 65535.
  const float cv = -1.0f + (2.0f * static_cast<float>(cell)) / kLast;
  // Number of map midpoints below cv (lower_bound), by binary search over the 255 midpoints
  // 0.5 * (D[k] + D[k+1]), computed on the fly with the table builder's float32 operations.
  int lo = 0, hi = 255;  // answer in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    const float m = 0.5f * (dynamic_map_value(mid) + dynamic_map_value(mid + 1));
    if (m < cv) lo = mid + 1;
    else hi = mid;
  }
  return static_cast<uint8_t>(lo);
}

// The 8-bit code of d in a 256-block with absmax a2 and r = 1 / a2 (r may overflow to inf for
// a2 < ~2.9e-39: then d * r is +-inf or NaN). An all-zero block (a2 == 0) stores code 0.
QF_HOST_DEVICE uint8_t double_quant_code(float d, float a2, float r) { return a2 == 0.0f ? 0 : dynamic_code_of(d * r); }

// One 256-block of d = absmax - offset: returns absmax2, writes the 8-bit codes.
QF_HOST_DEVICE float double_quant_block(const float* d, int64_t len, uint8_t* q) {
  float a2 = 0.0f;
  for (int64_t i = 0; i < len; ++i) a2 = abs_max_step(a2, d[i]);
  const float r = a2 == 0.0f ? 0.0f : 1.0f / a2;
  for (int64_t i = 0; i < len; ++i) q[i] = double_quant_code(d[i], a2, r);
  return a2;
}

QF_HOST_DEVICE float dequantize_absmax_value(uint8_t code, float absmax2, float offset) {
  const float scaled = dynamic_map_value(code) * absmax2;  // rounded ...
  return scaled + offset;                                  // ... then the add (no FMA)
}

// --- the compressed-statistics offset: torch's float32 mean on one CPU thread ------------------------
//
// torch's float32 Tensor.sum on the CPU (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum ->
// vectorized_inner_sum -> row_sum -> multi_row_sum), for a contiguous 1-D tensor reduced on one
// thread, as built for x86-64 (the sum kernel is an AVX2 kernel even on AVX-512 machines:
// Vectorized<float> has W = 8 lanes). Reproduced operation by operation:
//   * n >= W: the first n/W*W values are W-lane vectors v[0..nv). Vectors are read four at a time
//     ("ilp" rows k = 0..3: vector 4i+k goes to accumulator k) for i < nv/4, with a cascade of
//     4 levels: level 0 adds `step` = 2^max(4, ceil_log2(nv/4)/4) consecutive groups, then is
//     added into level 1 and cleared; level 1 is carried into level 2 every step^2 groups, level 2
//     into level 3 every step^3. Leftover groups go to level 0; then acc0 += acc1, += acc2, += acc3
//     (per lane, per ilp row). Leftover vectors (nv % 4) are added to ilp row 0, then rows 1, 2, 3
//     are added to row 0. The scalar result starts at 0, adds the n % W tail values in order, then
//     the W lanes of row 0 in lane order.
//   * n < W: the same with scalars instead of vectors (row_sum on scalars, 4 ilp accumulators).
//   * The output starts at 0 and the result is added to it (0 + s); then mean = sum / n.
// Each "+" is one float32 addition; the order above is the whole specification.
//
// Every (ilp row k, lane l) pair is an independent "stream" of float32 additions: for n >= 8,
// stream s = 8k + l adds x[32 g + s] over the groups g = 0 .. nv/4 - 1; for n < 8, stream k adds
// x[4 g + k]. A stream is: chunk sums (from 0, `step` groups each) pushed through the level carries
// (cascade_push), then the leftover groups and the carried levels (cascade_result). The CPU runs
// the 32 streams side by side in one pass; the CUDA kernel computes the chunk sums in parallel and
// pushes them in order. Both use the helpers below, so they share every addition.

constexpr int kSumLanes = 8;                // torch's Vectorized<float>::size() (AVX2)
constexpr int kSumStreams = 4 * kSumLanes;  // ilp rows x lanes
constexpr int kSumStreamsSmall = 4;         // n < 8: ilp rows of scalars

QF_HOST_DEVICE int64_t sum_ceil_log2(int64_t x) {  // c10 / ATen utils::CeilLog2
  if (x <= 2) return 1;
  int64_t r = 0;
  uint64_t v = static_cast<uint64_t>(x - 1);
  while (v) {
    ++r;
    v >>= 1;
  }
  return r;
}
// log2 of the level step for `groups` groups of 4: max(4, ceil_log2(groups) / 4).
QF_HOST_DEVICE int sum_level_power(int64_t groups) {
  const int64_t p = sum_ceil_log2(groups) / 4;
  return static_cast<int>(p > 4 ? p : 4);
}

// Levels 1..3 of one stream's cascade (level 0 is the running chunk sum, kept by the caller).
struct SumCascade {
  float l1 = 0.0f, l2 = 0.0f, l3 = 0.0f;
};

// A finished level-0 chunk sum, ending at group i_end (a multiple of the step 2^p), carried as
// torch's multi_row_sum does: into level 1; level 1 into level 2 when bits p..2p-1 of i_end are
// zero; level 2 into level 3 when bits 2p..3p-1 are zero too. A carried level restarts at 0.
QF_HOST_DEVICE void cascade_push(SumCascade& c, float chunk, int64_t i_end, int p) {
  const int64_t mask = (int64_t(1) << p) - 1;
  c.l1 = c.l1 + chunk;
  if ((i_end & (mask << p)) != 0) return;
  c.l2 = c.l2 + c.l1;
  c.l1 = 0.0f;
  if ((i_end & (mask << (2 * p))) != 0) return;
  c.l3 = c.l3 + c.l2;
  c.l2 = 0.0f;
}

// The stream's total: the level-0 sum of the leftover groups (from 0), then + l1, + l2, + l3.
QF_HOST_DEVICE float cascade_result(const SumCascade& c, float leftover) {
  float a = leftover + c.l1;
  a = a + c.l2;
  return a + c.l3;
}

// n >= 8: the 32 stream totals ps[8k + l] -> the mean (row_sum's leftover vectors and row merge,
// the scalar tail, the lanes, 0 + sum, / n).
QF_HOST_DEVICE float mean_finish(const float* ps, const float* x, int64_t n) {
  const int64_t nv = n / kSumLanes, groups = nv / 4;
  float row[kSumLanes];
  for (int l = 0; l < kSumLanes; ++l) row[l] = ps[l];
  for (int64_t i = groups * 4; i < nv; ++i)
    for (int l = 0; l < kSumLanes; ++l) row[l] = row[l] + x[i * kSumLanes + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < kSumLanes; ++l) row[l] = row[l] + ps[k * kSumLanes + l];
  float sum = 0.0f;
  for (int64_t i = nv * kSumLanes; i < n; ++i) sum = sum + x[i];
  for (int l = 0; l < kSumLanes; ++l) sum = sum + row[l];
  sum = 0.0f + sum;                    // the output tensor starts at 0 and accumulates
  return sum / static_cast<float>(n);  // Tensor.mean on the CPU: sum, then div_(numel)
}

// n < 8 (scalar path; at most one group of 4, so no chunk is ever complete); n == 0 gives torch's
// 0 / 0 on x86: the default NaN with the sign bit set (0xFFC00000).
QF_HOST_DEVICE float mean_small(const float* x, int64_t n) {
  if (n == 0) return f32_from_bits(0xFFC00000u);
  const int64_t groups = n / 4;
  float ps[kSumStreamsSmall];
  for (int k = 0; k < kSumStreamsSmall; ++k) {
    float a = 0.0f;
    for (int64_t g = 0; g < groups; ++g) a = a + x[4 * g + k];
    ps[k] = cascade_result(SumCascade{}, a);
  }
  float r = ps[0];
  for (int64_t i = groups * 4; i < n; ++i) r = r + x[i];
  for (int k = 1; k < kSumStreamsSmall; ++k) r = r + ps[k];
  const float sum = 0.0f + r;
  return sum / static_cast<float>(n);
}

// --- CPU kernels (nf4_cpu.cpp), threaded over blocks ------------------------------------------------

// x[0..n) -> packed[ceil(n/2)], absmax[ceil(n/blocksize)].
template <class T>
void quantize_cpu(const T* x, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax);
// packed, absmax (float32, decoded) -> y[0..n) of T = float, half_t or bf16_t (decoded in float32,
// rounded once to T).
template <class T>
void dequantize_cpu(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, T* y);
// Decode elements [i0, i1) of the flat tensor to float32 (used by the GEMM tile decoder).
void dequantize_range(const uint8_t* packed, const float* absmax, int64_t i0, int64_t i1, int64_t blocksize, float* y);
// float32 mean in torch's single-thread CPU summation order (bitsandbytes' absmax.mean()).
float mean_torch_order(const float* x, int64_t n);
// absmax[n_blocks] -> q[n_blocks] uint8, absmax2[ceil(n_blocks/256)], *offset.
void double_quant_cpu(const float* absmax, int64_t n_blocks, uint8_t* q, float* absmax2, float* offset);
// Inverse: q, absmax2, offset -> absmax[n_blocks] float32.
void dequantize_absmax_cpu(const uint8_t* q, const float* absmax2, float offset, int64_t n_blocks, float* absmax);

// --- CUDA kernels (nf4_cuda.cu): same arguments, device pointers, launched on `stream` (a
// cudaStream_t) on the current device. Same bytes as the CPU kernels. ------------------------------
template <class T>
void quantize_cuda(const T* x, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax, void* stream);
template <class T>
void dequantize_cuda(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, T* y, void* stream);
// The offset is computed on the device (torch's CPU order, see above) and written to offset[0].
void double_quant_cuda(const float* absmax, int64_t n_blocks, uint8_t* q, float* absmax2, float* offset, void* stream);
// `offset` is a device pointer to the one float32 offset.
void dequantize_absmax_cuda(const uint8_t* q, const float* absmax2, const float* offset, int64_t n_blocks,
                            float* absmax, void* stream);

}  // namespace qf::nf4
