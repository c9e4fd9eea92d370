// qformats._runtime._native: build and machine facts, the process's CPU thread setting, and the
// prefill kernel's tile rules for tests (exports, and the checks of prefill_plan's arguments).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "common/runtime.h"
#include "common/thread_pool.h"
#include "gemm/prefill_plan.h"
#include "gemm/weight_only_cuda.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "qformats runtime facts: CUDA build and devices, CPU thread count.";
  m.def("cuda_built", &qf::cuda_built, "True if the extension was compiled with CUDA kernels.");
  m.def("cuda_device_count", &qf::cuda_device_count,
        "Number of CUDA devices the runtime sees (0 without driver, GPU or CUDA build).");
  m.attr("MAX_THREADS") = qf::kMaxThreads;
  m.def("num_threads", &qf::num_threads, "Threads used by the CPU kernels of every format.");
  // Without the GIL: resizing a started pool waits for a running job, which may belong to a
  // thread that needs the GIL to finish its call.
  m.def("set_num_threads", &qf::set_num_threads, nb::arg("n"), nb::call_guard<nb::gil_scoped_release>(),
        "Set the threads of the CPU kernels of every format (clamped to [1, MAX_THREADS]).");
  m.def("num_threads_env_note", &qf::num_threads_env_note,
        "Why QFORMATS_NUM_THREADS was ignored or capped; empty when it was not.");
  m.def("pool_workers", &qf::pool_workers,
        "Worker threads of the CPU pool alive now (0 before the first parallel job).");
  m.def(
      "weight_only_workspace_bytes",
      [](int64_t N, int64_t M, int64_t K) -> int64_t {
#if defined(QFORMATS_WITH_CUDA)
        return qf::gemm::weight_only_workspace_bytes_cuda(N, M, K);
#else
        (void)N, (void)M, (void)K;
        return 0;
#endif
      },
      nb::arg("N"), nb::arg("M"), nb::arg("K"),
      "Bytes of device workspace that a CUDA weight-only GEMM of N activation rows by M weight rows, "
      "K deep, may use on the current device (int4, nf4 and q4_0's `gemm(..., workspace=)`; 0: none, and "
      "always 0 in a CPU-only build). A product with a smaller one or none gives the same numbers to "
      "within float32 rounding and may be slower.");
  m.def(
      "prefill_pieces",
      [](int cta, int ctas, int tiles, int ksteps, int sk_tiles) {
        if (ctas < 1 || cta < 0 || cta >= ctas || tiles < 0 || ksteps < 2 || ksteps % 2 || sk_tiles < 0 ||
            sk_tiles > tiles || (sk_tiles > 0 && ((tiles - sk_tiles) % ctas || sk_tiles < ctas)))
          throw nb::value_error(
              "prefill_pieces: needs 0 <= cta < ctas, tiles >= 0, an even ksteps >= 2, and sk_tiles 0 or at "
              "least ctas with tiles - sk_tiles a multiple of ctas");
        std::vector<std::tuple<int, int, int>> out;
        for (int i = 0;; ++i) {
          const qf::gemm::PrefillPiece p = qf::gemm::prefill_piece(i, cta, ctas, 0, 1, tiles, ksteps, sk_tiles);
          if (p.tile < 0) break;
          out.emplace_back(p.tile, p.kb, p.steps);
        }
        return out;
      },
      nb::arg("cta"), nb::arg("ctas"), nb::arg("tiles"), nb::arg("ksteps"), nb::arg("sk_tiles"),
      "The pieces of work of CTA `cta` of `ctas` persistent CTAs in the CUDA prefill kernel (no K "
      "split; src/gemm/prefill_plan.h's prefill_piece; for tests, no GPU needed): a list of (tile, "
      "first step, steps), `tiles` tiles of `ksteps` steps of 64 values, the last `sk_tiles` of them "
      "shared out by stream-K (0: none). Raises ValueError for arguments the kernel never gets.");
  m.def(
      "prefill_plan",
      [](int64_t N, int64_t M, int64_t K, int sms, nb::callable fits, bool stream_k) {
        constexpr int64_t kLimit = int64_t(1) << 31;
        if (N < 1 || M < 1 || N >= kLimit || M >= kLimit || K < 128 || K >= kLimit || K % 128 || sms < 1)
          throw nb::value_error(
              "prefill_plan: needs 1 <= N, M < 2^31, K a positive multiple of 128 below 2^31, sms >= 1");
        const qf::gemm::PrefillPlan p = qf::gemm::plan_prefill(
            N, M, K, sms,
            [&](qf::gemm::PrefillKind kind, int s, int64_t tiles) { return nb::cast<bool>(fits(int(kind), s, tiles)); },
            stream_k);
        return std::make_tuple(p.bm, p.bn, p.split, p.stream_k_tiles);
      },
      nb::arg("N"), nb::arg("M"), nb::arg("K"), nb::arg("sms"), nb::arg("fits"), nb::arg("stream_k") = false,
      "The CUDA prefill kernel's tile for Y [N, M] = X [N, K] . W [M, K]^T (N activation rows, M "
      "weight rows, K in elements) on a device of `sms` SMs, by the launcher's rules "
      "(src/gemm/prefill_plan.h; for tests, no GPU needed): a tuple of ints (bm weight rows, bn "
      "activation rows, split CTAs per tile along K, the last tiles shared out by stream-K), or (0, 0, "
      "0, 0) where the kernel declines; stream_k: as with the workspace that stream-K needs. "
      "fits(kind, s, tiles) -> bool says whether `tiles` clusters of s CTAs run at once (kind 0: "
      "128 x 256, 1: 128 x 128, 2: 64 x 128, 3: 128 x 192). Raises ValueError unless 1 <= N, M < 2^31, K is a "
      "positive multiple of 128 below 2^31 and sms >= 1; an exception from fits propagates.");
}
