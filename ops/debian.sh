# Sourced by the scripts under ops/ that need a tool from Debian (the machines reach only the
# package registries): `need_debian TOOL PACKAGE [WHAT FOR]` installs PACKAGE when TOOL is not on
# the PATH. As root it runs apt-get (once more after `apt-get update` if the first try fails);
# otherwise it says what to install and exits.
need_debian() {
    local tool="$1" package="$2" why="${3:-}"
    command -v "$tool" >/dev/null && return
    if [ "$(id -u)" != 0 ]; then
        echo "$tool is missing: install Debian's $package${why:+ ($why)}" >&2
        exit 1
    fi
    echo "installing Debian's $package${why:+ ($why)}" >&2
    { apt-get install -y "$package" >/dev/null 2>&1 ||
        { apt-get update >/dev/null && apt-get install -y "$package" >/dev/null; }; } || {
        echo "installing Debian's $package failed" >&2
        exit 1
    }
}
