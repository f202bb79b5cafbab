# FSDP_SANITIZE=ON: everything this project compiles is built with
# AddressSanitizer (LeakSanitizer included) and UndefinedBehaviorSanitizer,
# and the suites below L3 (L0-L2 and the core, tp and ep unit suites) get the
# label `sanitize` (`ctest -L sanitize`; the whole run is ci/sanitize.sh).
# LibTorch, Open MPI and HDF5 stay uninstrumented (Debian's builds): their
# memory errors are not found, but their leaks are reported, and the ones that
# are theirs by design are suppressed in cmake/sanitizers/, each with its reason.
#
# Included before any target is created: add_compile_options only reaches
# targets defined after it, and the precompiled headers must be compiled with
# the same flags as the files that use them.
set(FSDP_SANITIZE_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer
    -fno-sanitize-recover=undefined)
# GCC warns "may be used uninitialized" on instrumented code where there is no
# such use (GCC 12 on LibTorch's c10::optional<at::Generator> copies, in
# headers): the warning stays on in the normal build, which is the one that
# -Werror guards.
add_compile_options(${FSDP_SANITIZE_FLAGS} -Wno-maybe-uninitialized)
add_link_options(-fsanitize=address,undefined)

set(_supp "${CMAKE_CURRENT_LIST_DIR}/sanitizers")
# The ranks run with ASan's runtime first and the dlclose no-op after it
# (keep_loaded.c); mpiexec -x sets them for the ranks only, not for mpiexec.
enable_language(C)
add_library(fsdp_keep_loaded SHARED "${_supp}/keep_loaded.c")
execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libasan.so
                OUTPUT_VARIABLE _libasan OUTPUT_STRIP_TRAILING_WHITESPACE)
set(FSDP_SANITIZE_MPIEXEC_FLAGS -x "LD_PRELOAD=${_libasan} $<TARGET_FILE:fsdp_keep_loaded>")
# exitcode 23 for every sanitizer report, so a report fails the test even
# when the suite itself would have passed; halt at the first UB report.
set(FSDP_SANITIZE_ENV
    "ASAN_OPTIONS=exitcode=23:check_initialization_order=1:strict_init_order=1"
    "LSAN_OPTIONS=exitcode=23:suppressions=${_supp}/lsan.supp:print_suppressions=0"
    "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:suppressions=${_supp}/ubsan.supp")
message(STATUS "libfsdp: sanitizers ON (${FSDP_SANITIZE_FLAGS}); `ctest -L sanitize` runs the suites below L3")
