"""Where the C++ int4 kernel changes method with the batch (int4_linear.cpp's kGemvMaxRows,
panel_gemm.h's kMaxRows): up to GEMV_ROWS[isa] rows the GEMV, past them up to
LAST_PANEL_ROW[isa] the panel kernel (at::mm tiles in the generic build), past that a whole
dequantised weight for oneDNN (or at::mm tiles). A row's result does not depend on the batch
within either of the first two ranges, but the ranges round differently, so tests check them
apart."""

GEMV_ROWS = {"avx512": 12, "avx2": 5, "generic": 16}
LAST_PANEL_ROW = {"avx512": 383, "avx2": 383, "generic": 127}
