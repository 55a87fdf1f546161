"""Where the C++ int4 kernel changes method with the batch (int4_linear.cpp's kGemvMaxRows):
up to GEMV_ROWS[isa] rows the GEMV, past them up to LAST_PANEL_ROW the panel kernel (at::mm
tiles in the generic build). A row's result does not depend on the batch within either
range, but the two round differently, so tests check the ranges apart."""

GEMV_ROWS = {"avx512": 12, "avx2": 5, "generic": 16}
LAST_PANEL_ROW = 127
