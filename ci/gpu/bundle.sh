#!/usr/bin/env bash
# Prepares build-gpu-bundle/ (or $BUNDLE_DIR): the dependencies a bare GPU
# machine lacks (Open MPI, Boost.Test, HDF5 C/C++, CLI11, fmt, nlohmann-json),
# unpacked from Debian 12's .debs into a relocatable prefix <bundle>/usr, for
# the device tool to carry next to the working tree and ci/gpu/h200.sh to
# build against. Run HERE (Debian 12, network to the Debian mirror), from any
# directory:
#
#   ci/gpu/bundle.sh              # downloads into build-gpu-bundle-debs/, unpacks, checks
#   BUNDLE_CMAKE=1 ci/gpu/bundle.sh   # also CMake 3.25 (for a machine without one)
#
# What it does: `apt-get download` a seed list of packages, `dpkg -x` them,
# then closes the set over shared-library dependencies: every ELF file in the
# bundle (programs, libraries, Open MPI's MCA plugins) is run through ldd with
# only the bundle's library dirs on LD_LIBRARY_PATH, and each library resolved
# outside the bundle adds the Debian package that owns it (dpkg -S: the packages
# must be installed here, which ci/install-deps.sh does), until nothing new
# appears. glibc, libgcc and libstdc++ are the machine's own (never bundled);
# MANIFEST records the newest GLIBC_ / GLIBCXX_ symbol versions the bundle
# needs, which h200.sh checks. Docs, man pages, static libraries, Fortran and
# unused Boost headers are dropped; absolute symlinks are made relative.
# Ends by running the relocated `mpiexec -n 1 hostname` with the system's
# Open MPI hidden and printing `du` of the bundle and of the repository.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bundle="${BUNDLE_DIR:-$root/build-gpu-bundle}"
debs="${BUNDLE_DEBS:-$root/build-gpu-bundle-debs}"
arch_dir="lib/x86_64-linux-gnu"
prefix="$bundle/usr"

log() { echo "bundle: $*"; }
die() { echo "bundle: error: $*" >&2; exit 1; }

command -v apt-get >/dev/null && command -v dpkg >/dev/null || die "needs apt-get and dpkg (Debian 12)"
[ "$(dpkg --print-architecture)" = amd64 ] || die "needs an amd64 Debian"
grep -q 'VERSION_ID="12"' /etc/os-release || log "warning: not Debian 12; the MANIFEST's glibc need may be higher"

seed=(
  # Open MPI 4.1.4: mpiexec/orterun/orted, the wrapper compilers, headers, libmpi, MCA plugins
  openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev
  # Boost.Test 1.74: the shared library, its CMake package, the headers (pruned below)
  libboost-test1.74.0 libboost-test1.74-dev libboost1.74-dev
  # HDF5 1.10.8 serial, C and C++
  libhdf5-103-1 libhdf5-cpp-103-1 libhdf5-dev
  # header-only / small
  libcli11-dev libfmt9 libfmt-dev nlohmann-json3-dev
)
if [ "${BUNDLE_CMAKE:-0}" = 1 ]; then
  seed+=(cmake cmake-data)
fi
# Never bundled: the machine's C runtime (a second glibc cannot be loaded
# next to the system's; libstdc++/libgcc must be the ones torch uses).
base_re='^(libc6|libgcc-s1|libstdc\+\+6|libcrypt1)$'

mkdir -p "$debs" "$bundle"
rm -rf "$prefix" "$bundle/MANIFEST"
mkdir -p "$prefix"

declare -A have=()
fetch_and_unpack() {  # packages...
  local todo=() p
  for p in "$@"; do
    [ -n "${have[$p]:-}" ] && continue
    have[$p]=1
    todo+=("$p")
  done
  [ ${#todo[@]} -eq 0 ] && return 0
  log "download ${todo[*]}"
  # apt-get download wants a directory the _apt user may write; the warning
  # about an unsandboxed download as root is harmless.
  (cd "$debs" && apt-get download -qq "${todo[@]}" 2>&1 | grep -v 'unsandboxed' || true)
  for p in "${todo[@]}"; do
    local deb
    deb="$(ls -t "$debs/${p}_"*_{amd64,all}.deb 2>/dev/null | head -1 || true)"
    [ -n "$deb" ] || die "apt-get download $p produced no .deb in $debs"
    dpkg -x "$deb" "$bundle"
    echo "$(basename "$deb")" >> "$bundle/.packages"
  done
}

# Library dirs of the bundle (also where Open MPI's libs live).
bundle_libpath() {
  echo "$prefix/$arch_dir:$prefix/$arch_dir/openmpi/lib:$prefix/lib"
}
probe_libpath() { echo "$(bundle_libpath):$prefix/$arch_dir/hdf5-stubs"; }

# The owning package of a library path, trying the merged-/usr aliases.
declare -A owner_cache=()
owner_of() {
  local p="$1" r c
  if [ -n "${owner_cache[$p]:-}" ]; then echo "${owner_cache[$p]}"; return 0; fi
  r="$(readlink -f "$p")"
  for c in "$p" "$r" "${p#/usr}" "/usr${p}" "${r#/usr}" "/usr${r}"; do
    dpkg -S "$c" 2>/dev/null | head -1 | cut -d: -f1 && return 0
  done
  return 1
}

elf_files() {
  find "$prefix" -type f \( -name '*.so*' -o -perm -u+x \) -print0 |
    while IFS= read -r -d '' f; do
      head -c4 "$f" 2>/dev/null | grep -q $'\x7fELF' && printf '%s\n' "$f"
    done
}

rm -f "$bundle/.packages"
fetch_and_unpack "${seed[@]}"

# Open MPI: one node, shared memory (btl self/vader/tcp, pml ob1) is all the
# device run uses. The InfiniBand/OFI/UCX/PSM components and OpenSHMEM would
# pull ~10 MB of fabric libraries (ucx, libfabric, psm2, verbs, libnl).
mca="$prefix/$arch_dir/openmpi/lib/openmpi3"
rm -f "$mca"/mca_*_ucx.so "$mca"/mca_*_ofi.so "$mca"/mca_mtl_psm*.so "$mca"/mca_btl_openib.so \
      "$mca"/mca_spml_*.so "$mca"/mca_sshmem_*.so "$mca"/mca_memheap_*.so "$mca"/mca_scoll_*.so \
      "$mca"/mca_atomic_*.so "$mca"/mca_reachable_netlink.so "$mca"/mca_btl_uct.so "$mca"/mca_btl_usnic.so
rm -f "$prefix/$arch_dir"/openmpi/lib/libmca_common_{ofi,ucx,verbs,psm}* \
      "$prefix/$arch_dir"/libmca_common_{ofi,ucx,verbs,psm}*
rm -f "$prefix/$arch_dir"/liboshmem.so* "$prefix/$arch_dir"/openmpi/lib/liboshmem.so* \
      "$prefix"/bin/osh* "$prefix"/bin/shmem*

# HDF5 1.10.8 links libcurl and libcrypto for its read-only S3 driver (ROS3),
# which libfsdp never opens; their closure (curl, OpenSSL, GnuTLS, Kerberos,
# LDAP, ...) is ~16 MB. Instead: stub libraries with the 11 symbols HDF5
# imports, each returning an error (NULL / CURLE_FAILED_INIT), in
# hdf5-stubs/, found through HDF5's own RUNPATH ($ORIGIN/hdf5-stubs) only --
# never on LD_LIBRARY_PATH, so the machine's own curl/OpenSSL (cmake's,
# python's) are untouched.
stubs="$prefix/$arch_dir/hdf5-stubs"
mkdir -p "$stubs"
cat > "$stubs/curl.c" <<'C'
#include <stddef.h>
void* curl_easy_init(void) { return NULL; }
int curl_easy_setopt(void* h, int opt, ...) { (void)h; (void)opt; return 2; }
int curl_easy_perform(void* h) { (void)h; return 2; }
void curl_easy_cleanup(void* h) { (void)h; }
int curl_global_init(long flags) { (void)flags; return 2; }
void curl_global_cleanup(void) {}
void* curl_slist_append(void* l, const char* s) { (void)l; (void)s; return NULL; }
void curl_slist_free_all(void* l) { (void)l; }
C
cat > "$stubs/crypto.c" <<'C'
#include <stddef.h>
const void* EVP_sha256(void) { return NULL; }
unsigned char* HMAC(const void* md, const void* key, int kl, const unsigned char* d, size_t n,
                    unsigned char* out, unsigned int* ol) {
  (void)md; (void)key; (void)kl; (void)d; (void)n; (void)out; (void)ol; return NULL; }
unsigned char* SHA256(const unsigned char* d, size_t n, unsigned char* md) {
  (void)d; (void)n; (void)md; return NULL; }
C
echo 'CURL_OPENSSL_4 { global: curl_*; local: *; };' > "$stubs/curl.map"
echo 'OPENSSL_3.0.0 { global: EVP_sha256; HMAC; SHA256; local: *; };' > "$stubs/crypto.map"
command -v gcc >/dev/null || die "needs gcc for HDF5's curl/crypto stubs"
gcc -shared -fPIC -O1 -o "$stubs/libcurl.so.4" -Wl,-soname,libcurl.so.4 \
    -Wl,--version-script="$stubs/curl.map" "$stubs/curl.c"
gcc -shared -fPIC -O1 -o "$stubs/libcrypto.so.3" -Wl,-soname,libcrypto.so.3 \
    -Wl,--version-script="$stubs/crypto.map" "$stubs/crypto.c"
rm -f "$stubs"/*.c "$stubs"/*.map
patchelf="${PATCHELF:-$(command -v patchelf || true)}"
if [ -z "$patchelf" ]; then
  pe="$debs/patchelf-x"
  (cd "$debs" && apt-get download -qq patchelf 2>&1 | grep -v 'unsandboxed' || true)
  rm -rf "$pe"; mkdir -p "$pe"
  dpkg -x "$(ls -t "$debs"/patchelf_*.deb | head -1)" "$pe"
  patchelf="$pe/usr/bin/patchelf"
fi
for lib in "$prefix/$arch_dir"/libhdf5_serial.so.103.*; do
  "$patchelf" --set-rpath '$ORIGIN/hdf5-stubs' "$lib"
done

# Close over shared-library dependencies.
for round in 1 2 3 4 5 6 7 8; do
  declare -A need=()
  missing=()
  while IFS= read -r f; do
    while IFS= read -r line; do
      case "$line" in
        *"=> not found"*) missing+=("$(basename "$f"): ${line%% =>*}") ;;
        *"=> /"*)
          lib="$(awk '{print $3}' <<<"$line")"
          case "$lib" in "$bundle"/*) continue ;; esac
          pkg="${owner_cache[$lib]:-}"
          [ -n "$pkg" ] || pkg="$(owner_of "$lib" || true)"
          owner_cache[$lib]="$pkg"
          [ -n "$pkg" ] || die "no installed package owns $lib (needed by $f)"
          pkg="${pkg%%:*}"
          [[ "$pkg" =~ $base_re ]] && continue
          need[$pkg]=1
          ;;
      esac
    done < <(LD_LIBRARY_PATH="$(probe_libpath)" ldd "$f" 2>/dev/null || true)
  done < <(elf_files)
  new=()
  for p in "${!need[@]}"; do [ -n "${have[$p]:-}" ] || new+=("$p"); done
  if [ ${#new[@]} -eq 0 ]; then
    log "closure complete after $round round(s)"
    break
  fi
  log "round $round: adds ${new[*]}"
  fetch_and_unpack "${new[@]}"
  unset need
done
if [ ${#missing[@]} -gt 0 ]; then
  printf 'bundle: warning: unresolved: %s\n' "${missing[@]}" | sort -u >&2
fi

# ---- prune ----
rm -rf "$prefix/share/doc" "$prefix/share/man" "$prefix/share/info" "$prefix/share/lintian" \
       "$prefix/share/locale" "$prefix/share/bug" "$prefix/share/doc-base" "$bundle/etc/bash_completion.d" \
       "$prefix/share/cmake-3.25/Help" "$prefix/share/emacs" "$prefix/share/vim" "$prefix/share/aclocal" \
       "$prefix/share/bash-completion" "$prefix/share/applications" "$prefix/share/icons" \
       "$prefix/share/mime" "$prefix/share/pixmaps"
find "$prefix" -name '*.a' -delete
# Fortran (HDF5's and Open MPI's) and the HDF5 wrapper scripts, which hold
# absolute /usr paths: FindHDF5 is pointed at the library dir instead.
find "$prefix" \( -name '*fortran*' -o -name '*.mod' -o -name 'libmpi_mpifh*' -o -name 'libmpi_usempi*' \) \
  -exec rm -rf {} + 2>/dev/null || true
rm -f "$prefix"/bin/h5cc* "$prefix"/bin/h5c++* "$prefix"/bin/h5fc* "$prefix"/bin/h5pcc*
# HDF5 tools (h5dump, h5diff, ...) are not used on the device.
find "$prefix/bin" -maxdepth 1 -name 'h5*' -delete 2>/dev/null || true

# Boost: keep the header files that libfsdp's Boost includes (with the flags
# mpi_tests use, and the header-only Boost.Test form) reach, plus config/ and
# test/ whole (compiler- and platform-selected headers).
boost_keep() {
  local tu="$bundle/.boost-probe.cpp" tu2="$bundle/.boost-probe2.cpp"
  grep -rhoE '#include <boost/[^>]+>' "$root/mpi_tests" "$root/libfsdp" "$root/models" \
    "$root/reference" "$root/examples" 2>/dev/null | sort -u > "$tu"
  echo '#include <boost/test/included/unit_test.hpp>' > "$tu2"
  {
    g++ -std=c++17 -DBOOST_TEST_DYN_LINK -DBOOST_TEST_NO_MAIN -I"$prefix/include" -M "$tu"
    g++ -std=c++17 -I"$prefix/include" -M "$tu2"
  } 2>/dev/null | tr ' ' '\n' | grep "^$prefix/include/boost/" | sort -u
  rm -f "$tu" "$tu2"
}
if [ -d "$prefix/include/boost" ]; then
  command -v g++ >/dev/null || die "needs g++ to prune the Boost headers"
  keep_list="$bundle/.boost-keep"
  boost_keep > "$keep_list"
  [ "$(wc -l < "$keep_list")" -gt 100 ] || die "Boost header probe failed ($(wc -l < "$keep_list") files)"
  find "$prefix/include/boost/config" "$prefix/include/boost/test" -type f >> "$keep_list"
  before="$(find "$prefix/include/boost" -type f | wc -l)"
  find "$prefix/include/boost" -type f | sort | comm -23 - <(sort -u "$keep_list") | xargs -r rm -f
  find "$prefix/include/boost" -type d -empty -delete
  log "Boost headers: kept $(find "$prefix/include/boost" -type f | wc -l) of $before files"
  rm -f "$keep_list"
fi

# Debian's alternatives (mpiexec, mpicxx, ...) are not in the .debs: add the
# links, relative.
for tool in mpiexec mpirun mpicc mpicxx mpic++ orterun; do
  if [ -e "$prefix/bin/$tool.openmpi" ] && [ ! -e "$prefix/bin/$tool" ]; then
    ln -s "$tool.openmpi" "$prefix/bin/$tool"
  fi
done
# Absolute symlinks -> relative (they would point into the host's /usr).
while IFS= read -r -d '' l; do
  t="$(readlink "$l")"
  case "$t" in
    /*)
      if [ -e "$bundle$t" ] || [ -L "$bundle$t" ]; then
        ln -sfn "$(realpath -m --relative-to="$(dirname "$l")" "$bundle$t")" "$l"
      else
        rm -f "$l"
      fi
      ;;
  esac
done < <(find "$bundle" -type l -print0)
# Dangling symlinks (into pruned files).
find "$bundle" -xtype l -delete
rm -rf "$bundle/etc/alternatives"

# ---- manifest: what the bundle needs from the machine ----
max_ver() { sort -t. -k1,1n -k2,2n -k3,3n | tail -1; }
glibc_need="$(elf_files | xargs -r objdump -T 2>/dev/null | grep -oE 'GLIBC_[0-9]+\.[0-9]+(\.[0-9]+)?' |
  sed 's/GLIBC_//' | max_ver || true)"
glibcxx_need="$(elf_files | xargs -r objdump -T 2>/dev/null | grep -oE 'GLIBCXX_[0-9]+\.[0-9]+(\.[0-9]+)?' |
  sed 's/GLIBCXX_//' | max_ver || true)"
{
  echo "# ci/gpu/bundle.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release; echo "$PRETTY_NAME")"
  echo "glibc_min=$glibc_need"
  echo "glibcxx_min=$glibcxx_need"
  echo "openmpi=$(dpkg-deb -f "$(ls "$debs"/libopenmpi3_*.deb | head -1)" Version)"
  echo "boost=1.74"
  echo "hdf5=$(dpkg-deb -f "$(ls "$debs"/libhdf5-103-1_*.deb | head -1)" Version)"
  echo "cmake_bundled=${BUNDLE_CMAKE:-0}"
  echo "packages=$(sort -u "$bundle/.packages" | sed 's/_.*//' | tr '\n' ' ')"
} > "$bundle/MANIFEST"
rm -f "$bundle/.packages"
log "MANIFEST:"; sed 's/^/  /' "$bundle/MANIFEST"

# ---- check: the relocated Open MPI, with the system's hidden ----
# Only the bundle on PATH / LD_LIBRARY_PATH (plus /bin for hostname and
# the shell): a machine without Open MPI.
check_env=(env -i HOME="$HOME" PATH="$prefix/bin:/bin" LD_LIBRARY_PATH="$(bundle_libpath)"
           OPAL_PREFIX="$prefix" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
           OMPI_MCA_plm_rsh_agent=false)
log "ldd of the bundle's mpiexec / libmpi (every Open MPI library from the bundle):"
for f in "$prefix/bin/orterun" "$prefix/$arch_dir/libmpi.so.40"; do
  "${check_env[@]}" ldd "$f" | grep -E 'open-pal|open-rte|libmpi|hwloc|event|pmix' | sed 's/^/  /'
  if "${check_env[@]}" ldd "$f" | grep -E 'open-pal|open-rte|libmpi\.|hwloc|event' | grep -vq "$bundle"; then
    die "$f loads an Open MPI library from outside the bundle"
  fi
done
log "ldd of the bundle's libhdf5_serial_cpp (curl/crypto from hdf5-stubs, nothing missing):"
"${check_env[@]}" ldd "$prefix/$arch_dir"/libhdf5_serial_cpp.so.103 | grep -E 'hdf5|curl|crypto|sz|aec|not found' | sed 's/^/  /'
if "${check_env[@]}" ldd "$prefix/$arch_dir"/libhdf5_serial_cpp.so.103 | grep -q 'not found'; then
  die "libhdf5_serial_cpp has unresolved libraries"
fi
log "relocated: mpiexec -n 1 hostname (which mpiexec: $("${check_env[@]}" bash -c 'command -v mpiexec'))"
"${check_env[@]}" mpiexec -n 1 hostname || die "the bundle's mpiexec -n 1 hostname failed"
"${check_env[@]}" mpicxx --showme:compile | sed 's/^/bundle: mpicxx --showme:compile: /'
"${check_env[@]}" mpicxx --showme:compile | grep -q "$prefix" ||
  die "mpicxx --showme does not point into the bundle (OPAL_PREFIX ignored?)"

log "size: $(du -sh "$bundle" | cut -f1) in $bundle ($(du -sb "$bundle" | cut -f1) bytes)"
repo_bytes="$(cd "$root" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)"
bundle_bytes="$(du -sb "$bundle" | cut -f1)"
log "repository tracked files: $repo_bytes bytes; with the bundle $((repo_bytes + bundle_bytes)) of the carry limit 67108864"
[ $((repo_bytes + bundle_bytes)) -lt 67108864 ] || die "repository + bundle exceed the 64 MiB carry limit"
log "done: carry '$(realpath --relative-to="$root" "$bundle")'"
