# Issue 30: planted symbolic links at every checkpoint file name (test_ckpt_links).
sg_add_test(test_ckpt_links SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_links.c LABELS local
            TIMEOUT 120)
# fork() after training: children create engines, train, save and exit under a deadline.
sg_add_test(test_fork SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_fork.c LABELS local TIMEOUT 180)
