// Keeps qf_gemm a valid library whatever kernels src/gemm has (all CPU GEMMs are headers + .cpp).
