# Checkpoints (issue 5): save/load at any world size, damaged files, kill -9 during saves,
# safetensors export/import. Ranks run as threads (label local).
sg_add_test(test_ckpt SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt.c LABELS local TIMEOUT 300)
sg_add_test(test_ckpt_corrupt SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_corrupt.c LABELS local TIMEOUT 300)
sg_add_test(test_ckpt_kill SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_kill.c LABELS local TIMEOUT 300)
