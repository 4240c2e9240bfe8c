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

# stager_resolve PATH: prints PATH's real path, walked from / one component at a time as the kernel
# resolves it, and returns 0 when no symbolic link on the way could have been put there or re-pointed by
# anyone but root: a link is followed only when it is root's, or its directory is root's and not
# writable by group or others (the kernel's fs.protected_symlinks rule, which this does not rely on: a
# user's /tmp/x -> /root-only is refused). Components that do not exist yet are appended as given
# (normalised). Prints why not and returns 1 otherwise. Everything after a check uses the real path,
# never the one given (nobody else can rename or replace a component of it: stager_chain_problem).
stager_resolve() {
    local rest=$1 cur=/ comp next luid dinfo duid dmode target links=0 missing=""
    case "$rest" in /*) ;; *) echo "$1 is not an absolute path"; return 1 ;; esac
    while :; do
        rest=${rest#"${rest%%[!/]*}"}
        [ -n "$rest" ] || break
        comp=${rest%%/*}
        case "$rest" in */*) rest=${rest#*/} ;; *) rest="" ;; esac
        case "$comp" in
            .) continue ;;
            ..) cur=$(dirname -- "$cur"); continue ;;
        esac
        next=${cur%/}/$comp
        if [ -n "$missing" ]; then
            cur=$next
        elif [ -L "$next" ]; then
            luid=$(stat -c %u -- "$next" 2>/dev/null) || { echo "cannot stat $next"; return 1; }
            dinfo=$(stat -c %u:%a -- "$cur" 2>/dev/null) || { echo "cannot stat $cur"; return 1; }
            duid=${dinfo%%:*}; dmode=${dinfo#*:}
            if [ "$luid" != 0 ] && { [ "$duid" != 0 ] || [ $((8#$dmode & 8#022)) -ne 0 ]; }; then
                echo "$1 passes through the symbolic link $next, owned by uid $luid in $cur (uid $duid, mode $dmode), which others can re-point; give its real path"
                return 1
            fi
            links=$((links + 1))
            [ "$links" -le 40 ] || { echo "$1: more than 40 symbolic links on the way"; return 1; }
            target=$(readlink -- "$next") || { echo "cannot read the link $next"; return 1; }
            case "$target" in /*) cur=/ ;; esac
            rest=$target${rest:+/$rest}
        elif [ -e "$next" ]; then
            cur=$next
        else
            missing=1
            cur=$next
        fi
    done
    printf '%s\n' "$cur"
}

# stager_chain_problem REAL: prints why a directory above the real path REAL (stager_resolve) could be
# changed by someone other than root (owned by another uid, or writable by others and not sticky) and
# returns 1; else returns 0. Directories that do not exist yet are skipped (their creator checks them).
stager_chain_problem() {
    local p info uid mode
    p=$(dirname -- "$1")
    while [ ! -e "$p" ] && [ ! -L "$p" ]; do p=$(dirname -- "$p"); done
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

# stager_mkdirs REAL: makes the missing directories above REAL (a real path), one at a time, each
# exclusively (mkdir never follows a name planted meanwhile) and checked to be root's. Prints why not.
stager_mkdirs() {
    local p=$1 todo=""
    p=$(dirname -- "$p")
    while [ ! -e "$p" ] && [ ! -L "$p" ]; do todo="$p${todo:+
$todo}"; p=$(dirname -- "$p"); done
    [ -n "$todo" ] || return 0
    while IFS= read -r p; do
        mkdir -m 0755 -- "$p" 2>/dev/null
        stager_dir_problem "$p" 0 || return 1
    done <<< "$todo"
}

# stager_root_dir PATH [create]: prints the real path of PATH, a safe root-owned directory (created 0755
# when missing and "create" is given) reached through no link anyone but root controls, and returns 0.
# Prints the reason and returns 1 otherwise. Use the printed path from then on.
stager_root_dir() {
    local real
    real=$(stager_resolve "$1") || { echo "$real"; return 1; }
    stager_chain_problem "$real" || return 1
    if [ "${2:-}" = create ] && [ ! -e "$real" ] && [ ! -L "$real" ]; then
        stager_mkdirs "$real" || return 1
        mkdir -m 0755 -- "$real" 2>/dev/null  # exclusive: never through a name planted meanwhile
    fi
    stager_dir_problem "$real" 0 || return 1
    printf '%s\n' "$real"
}

# stager_redact TEXT: TEXT with URL credentials and query values masked (stager.redact's rule) and its
# control characters (C0 and C1, DEL, newlines, the bidirectional overrides) replaced by '?' and every
# byte that is not part of UTF-8 (a lone 0x9b is an 8-bit CSI to some terminals) dropped: it goes into the job's
# AdminComment, root's failure record and the job's output (names others chose end up there).
stager_redact() {
    printf '%s' "$1" | tr '\n' ' ' | stager_utf8_only |
        LC_ALL=C sed -E 's#([A-Za-z][A-Za-z0-9+.-]*://)[^/@ ]*@#\1***@#g; s#(://[^ ?]*)\?[^ ]*#\1?***#g;
                         s#\xc2[\x80-\x9f]#?#g; s#\xe2\x80[\xaa-\xae]#?#g; s#\xe2\x81[\xa6-\xa9]#?#g' |
        LC_ALL=C tr '\000-\010\013-\037\177' '?'
    echo
}

# stager_utf8_only: stdin to stdout without the bytes that are not part of well-formed UTF-8 (iconv -c;
# where iconv is missing, every byte past ASCII becomes '?').
stager_utf8_only() {
    if command -v iconv >/dev/null 2>&1; then
        iconv -c -f UTF-8 -t UTF-8 2>/dev/null
        return 0
    fi
    LC_ALL=C tr '\200-\377' '?'
}

# stager_cache_dir PATH SERVICE_UID: prints the real path of the site cache's directory, made for the
# service account when missing (exclusively, 0755, then given to it) under directories only root can
# change and reached through no link anyone but root controls; prints why not and returns 1 when it is
# not a real directory of SERVICE_UID's that others cannot write. Root does nothing else with it: the
# service account fills it (stager/cache/, docs/security.md).
stager_cache_dir() {
    local real
    real=$(stager_resolve "$1") || { echo "$real"; return 1; }
    stager_chain_problem "$real" || return 1
    if [ ! -e "$real" ] && [ ! -L "$real" ]; then
        stager_mkdirs "$real" || return 1
        mkdir -m 0755 -- "$real" 2>/dev/null && chown -h "$2" -- "$real"
    fi
    stager_dir_problem "$real" "$2" || return 1
    printf '%s\n' "$real"
}

# stager_unmount_user_mounts DIR UID [GID]: unmount every FUSE mount at or below DIR (a real path root
# checked), deepest first, *as UID* with fusermount3 (else fusermount) -u -z: fusermount unmounts only its
# caller's own mounts, so whatever path a mount point's name leads to, nothing but that user's mounts
# can go (a user who renames a mount point to point elsewhere unmounts only their own). Mount points come
# from /proc/self/mountinfo (its octal escapes decoded). What stays mounted (another user's FUSE mount,
# which that user cannot have made in DIR without access to it) is left: rm -rf --one-file-system does
# not cross it. Never fails.
stager_unmount_user_mounts() {
    local dir=$1 uid=$2 gid=${3:-} fm point
    case "$uid" in ''|*[!0-9]*) return 0 ;; esac
    case "$gid" in ''|*[!0-9]*) gid=$(id -g "$uid" 2>/dev/null) || gid=$uid ;; esac
    fm=$(command -v fusermount3 || command -v fusermount) || return 0
    while IFS= read -r point; do
        [ -n "$point" ] || continue
        setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$fm" -u -z -- "$point" >/dev/null 2>&1 || true
    done < <(awk -v d="$dir" '$0 ~ / - fuse/ {
                 p = $5; out = ""
                 while ((i = index(p, "\\")) > 0) {  # \040 and the other octal escapes of mountinfo
                     out = out substr(p, 1, i - 1) sprintf("%c", (substr(p, i + 1, 1) * 64 + substr(p, i + 2, 1) * 8 + substr(p, i + 3, 1)))
                     p = substr(p, i + 4)
                 }
                 p = out p
                 if (p == d || index(p, d "/") == 1) print length(p) "\t" p
             }' /proc/self/mountinfo | sort -rn | cut -f2-)
    return 0
}
