/* Preloaded into the sanitize label's test ranks (cmake/Sanitizers.cmake):
 * dlclose does nothing, so the libraries Open MPI 4.1 opens for its components
 * and closes in MPI_Init (the ones it did not select) and MPI_Finalize stay
 * mapped. LeakSanitizer then names them in its reports, and lsan.supp can
 * suppress their start-up allocations by library name instead of leaving
 * "<unknown module>" frames nothing can match. */
int dlclose(void* handle) {
  (void)handle;
  return 0;
}
