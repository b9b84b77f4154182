# Element math and CPU loops (kernels/sg_elem.h, kernels/cpu), and AdamW against PyTorch's
# numbers (tests/data/adamw_*.bin, written by scripts/gen_adamw_ref.py).
sg_add_test(test_elem SOURCES test_elem.c LABELS unit TIMEOUT 300)
sg_add_test(test_adamw_ref SOURCES test_adamw_ref.c LABELS unit TIMEOUT 120)
