# Sourced by the scripts: installs the Debian packages that are missing, as root or
# through sudo, and skips those already present.
require_packages() {
    local missing=()
    local package
    for package in "$@"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "memattn: installing missing packages: ${missing[*]}"
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "memattn: need root or sudo to install ${missing[*]}" >&2; return 1; }
        sudo=(sudo)
    fi
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# Compiles through ccache (installed if missing) in the build trees configured from now
# on, unless the caller chose a launcher (CMAKE_CXX_COMPILER_LAUNCHER) or turned it off
# (MEMATTN_CCACHE=0). The cache is the machine's (ccache's default directory, or
# CCACHE_DIR), so a rebuild of sources already compiled here, in any clone, is a copy:
# paths under the clone are hashed relative to it (CCACHE_BASEDIR), and the build
# directory is left out of the hash (CCACHE_NOHASHDIR; the objects' debug paths then
# name the first clone that built them). A compile that fails or warns into -Werror is
# never cached, so the tests that expect a diagnostic still see it.
use_ccache() {
    local root=$1
    [ "${MEMATTN_CCACHE:-1}" != 0 ] || return 0
    [ -z "${CMAKE_CXX_COMPILER_LAUNCHER:-}" ] || return 0
    require_packages ccache
    export CMAKE_CXX_COMPILER_LAUNCHER=ccache
    export CCACHE_BASEDIR="$root"
    export CCACHE_NOHASHDIR=true
    export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
    # The header check's precompiled header (tests/CMakeLists.txt): ccache caches the
    # units that read it only when told that its __DATE__/__TIME__ and its macros need
    # not be hashed by their text (ccache's manual, "Precompiled headers").
    export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros}"
}
