// Keeps qf_gemm a valid library while src/gemm has no sources of a kind.
