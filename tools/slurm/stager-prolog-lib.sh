# shellcheck shell=bash
# stager prolog service: what stager-prolog, -epilog and -taskprolog share (sourced, not run).
# docs/security.md says why each rule exists; docs/staging.md, "The prolog service", how it is used.
#
# The trust rules of stager.fs.safe, for root-run shell: a directory root writes into or removes from
# is a real directory (never a symlink) owned by root and not writable by group or others, under
# directories that are root's and not writable by others unless sticky (/tmp). stat(1) without -L
# reports a symlink itself, never its target.

# The layout (all node-local):
#   $STAGER_PROLOG_ROOT/            root 0755   (default /tmp/stager-prolog: set it to a root-only place)
#   $STAGER_PROLOG_ROOT/job<id>/    the job's user, 0700: the copies; the job's STAGER_DEST
#   $STAGER_PROLOG_STATE/           root 0755   (default /run/stager-prolog)
#   $STAGER_PROLOG_STATE/job<id>/   root 0700: root's own files (captured stage output)
#   $STAGER_PROLOG_STATE/job<id>.failed  root 0644: a failed stage's one line, for the task prolog
stager_prolog_config() {
    conf=${STAGER_PROLOG_CONF:-/etc/stager/prolog.conf}
    # shellcheck disable=SC1090
    [ -r "$conf" ] && . "$conf"
    STAGER=${STAGER:-stager}
    ROOT=${STAGER_PROLOG_ROOT:-/tmp/stager-prolog}
    STATE=${STAGER_PROLOG_STATE:-/run/stager-prolog}
    case "$ROOT" in /*) ;; *) ROOT=/nonexistent/relative-STAGER_PROLOG_ROOT ;; esac
    case "$STATE" in /*) ;; *) STATE=/nonexistent/relative-STAGER_PROLOG_STATE ;; esac
}

# stager_dir_problem PATH OWNER_UID: prints why PATH is not a real directory owned by OWNER_UID and
# not writable by group or others, and returns 1; prints nothing and returns 0 when it is.
stager_dir_problem() {
    local info uid mode kind
    info=$(stat -c '%u:%a:%F' -- "$1" 2>/dev/null) || { echo "$1 does not exist"; return 1; }
    uid=${info%%:*}; info=${info#*:}; mode=${info%%:*}; kind=${info#*:}
    if [ "$kind" != directory ]; then
        echo "$1 is a $kind owned by uid $uid, mode $mode, expected a directory (links are not followed)"; return 1
    fi
    if [ "$uid" != "$2" ] || [ $((8#$mode & 8#022)) -ne 0 ]; then
        echo "$1 is a directory owned by uid $uid, mode $mode; expected owned by uid $2 and not writable by group or others"
        return 1
    fi
    return 0
}

# stager_chain_problem PATH: prints why a directory above PATH could be changed by someone other than
# root (owned by another uid, or writable by others and not sticky) and returns 1; else returns 0.
stager_chain_problem() {
    local p info uid mode
    p=$(dirname -- "$1")
    p=$(realpath -e -- "$p" 2>/dev/null) || { echo "$(dirname -- "$1") does not exist"; return 1; }
    while :; do
        info=$(stat -c '%u:%a' -- "$p" 2>/dev/null) || { echo "cannot stat $p"; return 1; }
        uid=${info%%:*}; mode=${info#*:}
        if [ "$uid" != 0 ] || { [ $((8#$mode & 8#022)) -ne 0 ] && [ $((8#$mode & 8#1000)) -eq 0 ]; }; then
            echo "$1 lies in $p, owned by uid $uid with mode $mode (only root may be able to change it)"; return 1
        fi
        [ "$p" = / ] && return 0
        p=$(dirname -- "$p")
    done
}

# stager_root_dir PATH [create]: PATH is a safe root-owned directory (created 0755 when missing and
# "create" is given). Prints the reason and returns 1 otherwise.
stager_root_dir() {
    stager_chain_problem "$1" || return 1
    if [ "${2:-}" = create ] && [ ! -e "$1" ] && [ ! -L "$1" ]; then
        mkdir -p -m 0755 -- "$(dirname -- "$1")" 2>/dev/null
        mkdir -m 0755 -- "$1" 2>/dev/null  # exclusive: never through a name planted meanwhile
    fi
    stager_dir_problem "$1" 0
}

# stager_redact TEXT: TEXT with URL credentials and query values masked (stager.redact's rule).
stager_redact() {
    printf '%s\n' "$1" | sed -E 's#([A-Za-z][A-Za-z0-9+.-]*://)[^/@ ]*@#\1***@#g; s#(://[^ ?]*)\?[^ ]*#\1?***#g'
}

# stager_cache_dir PATH SERVICE_UID: the site cache's directory, made for the service account when missing
# (exclusively, 0755, then given to it) under directories only root can change; prints why not and
# returns 1 when it is not a real directory of SERVICE_UID's that others cannot write. Root does nothing
# else with it: the service account fills it (stager/cache/, docs/security.md).
stager_cache_dir() {
    stager_chain_problem "$1" || return 1
    if [ ! -e "$1" ] && [ ! -L "$1" ]; then
        mkdir -m 0755 -- "$1" 2>/dev/null && chown -h "$2" -- "$1"
    fi
    stager_dir_problem "$1" "$2"
}
