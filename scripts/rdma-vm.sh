#!/usr/bin/env bash
# Run programs against real Soft-RoCE (rdma_rxe) verbs in throw-away qemu guests: Debian's
# own kernel (apt-get download + dpkg -x, never installed on the host) and a busybox
# initramfs that holds rdma-core, perftest, iproute2 and the binaries you give it.
#
# Usage (root, Debian 12):
#   RDMAVM_BINS="/path/a /path/b" RDMAVM_SINGLE_CMD='a --flag'            scripts/rdma-vm.sh single
#   RDMAVM_BINS=... RDMAVM_SERVER_CMD='...' RDMAVM_CLIENT_CMD='...'       scripts/rdma-vm.sh two-vm
#
#   single : one VM; rxe0 on dummy0 (10.77.0.1/24, MTU 9000). Processes in that guest talk
#            through rxe's loopback (source IP = destination IP).
#   two-vm : VM 1 "server" (10.77.0.1) and VM 2 "client" (10.77.0.2), each with rxe0 on a
#            virtio-net eth0 (MTU 9000). The two NICs are joined back to back by a qemu
#            `-netdev stream` over a unix socket: lossless, and nothing leaves the host.
#            The two commands start concurrently, and neither waits for the other.
#
# Environment:
#   RDMAVM_BINS        space-separated host paths of executables (ideally static). Each goes to
#                      /opt/gs/bin/<basename> in the guest; libraries that ldd lists are copied too.
#   RDMAVM_SINGLE_CMD  command for `single`        (default: ibv_devinfo -d rxe0)
#   RDMAVM_SERVER_CMD  command for VM 1 of two-vm  (default: ibv_devinfo -d rxe0)
#   RDMAVM_CLIENT_CMD  command for VM 2 of two-vm  (default: ping -c 3 $RDMAVM_PEER_IP)
#   RDMAVM_TIMEOUT     seconds per VM, boot included (default 600)
#   RDMAVM_DIR         build and cache directory (default /tmp/gradsync-rdma-vm)
#   RDMAVM_MEM, RDMAVM_SMP   guest memory in MiB and vCPUs (default 2048 and 2)
#   RDMAVM_ACCEL       kvm|tcg (default: tcg when /dev/kvm is kvm_pvm or unusable, else kvm)
#
# Each command runs as `sh -c "$CMD"` (busybox ash), as root, in /root, with the console as
# stdout and stderr, after this setup: /proc, /sys, devtmpfs, /dev/pts; tmpfs on /tmp,
# /dev/shm (writable, 80 % of RAM) and /run; modules rdma_rxe, ib_uverbs, rdma_ucm,
# crc32, veth, dummy, virtio_net loaded; lo up; rxe0 up with an active port. Its environment:
#   PATH               /opt/gs/bin first; also ibv_devices, ibv_devinfo, ibv_rc_pingpong,
#                      ib_{write,read,send}_{bw,lat}, rdma, /usr/sbin/ip (iproute2) and busybox
#   RDMAVM_ROLE        single | server | client
#   RDMAVM_IP          this VM's address (10.77.0.1 or 10.77.0.2)
#   RDMAVM_PEER_IP     the other VM's address (two-vm only)
#   RDMAVM_DEV         the netdev under rxe0 (dummy0 or eth0)
#   RDMAVM_GID_INDEX   GID index of rxe0's RoCE v2 IPv4-mapped GID of RDMAVM_IP
# The client side usually has to wait for the server side. For that the guest has a `retry`
# script on PATH (usable from the command, from scripts and from programs):
#   retry [-n TRIES] [-s SECONDS] CMD ARGS...   rerun CMD until it exits 0 (default 60 x 1 s)
# e.g. (single quotes: the variables are expanded in the guest)
#   RDMAVM_SERVER_CMD='ib_write_bw -d rxe0 -x $RDMAVM_GID_INDEX -F -s 65536 -n 200'
#   RDMAVM_CLIENT_CMD='retry ib_write_bw -d rxe0 -x $RDMAVM_GID_INDEX -F -s 65536 -n 200 $RDMAVM_PEER_IP'
# A TCP check with busybox nc (it has no -z; don't probe a port whose server expects a
# handshake, since a probe is a real connection):
#   RDMAVM_SERVER_CMD='nc -l -p 5000 >/tmp/got; cat /tmp/got; grep -q hello /tmp/got'
#   RDMAVM_CLIENT_CMD='retry -s 0.5 sh -c "echo hello | nc $RDMAVM_PEER_IP 5000"'
# Note: busybox ash runs its own applets before PATH, so a bare `ip` is busybox's; use
# /usr/sbin/ip for full iproute2.
#
# Output: guest consoles stream to stdout with a "[single]", "[server]" or "[client]" prefix,
# and are kept (\r stripped) in $RDMAVM_DIR/<role>.log. A guest prints
# "RDMAVM: PASS guest command" or "RDMAVM: FAIL guest command (rc=N)", then "RDMAVM: done".
# Exit status: 0 only if every VM passed and finished; otherwise 1 with one line per failed
# VM saying why. In two-vm mode, when one VM fails, the other gets 30 s, then is stopped.
#
# Cached in RDMAVM_DIR: the extracted kernel (~400 MB). Rebuilt on every run: the initramfs.
# Runs holding the same RDMAVM_DIR are serialized with flock.
set -euo pipefail

MODE=${1:-}
case $MODE in
    single | two-vm) ;;
    *) echo "usage: $0 single|two-vm   (see the comment at the top of $0)" >&2; exit 2 ;;
esac
die() { echo "rdma-vm: FAIL: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "rdma-vm: must run as root (apt-get, depmod)" >&2; exit 2; }

HERE=$(cd "$(dirname "$0")" && pwd)
GUEST_INIT=$HERE/rdma-vm-guest.sh
DIR=${RDMAVM_DIR:-/tmp/gradsync-rdma-vm}
TIMEOUT=${RDMAVM_TIMEOUT:-600}
MEM=${RDMAVM_MEM:-2048}
SMP=${RDMAVM_SMP:-2}
PEER_GRACE=30
for v in "$TIMEOUT" "$MEM" "$SMP"; do
    case $v in '' | *[!0-9]*) echo "rdma-vm: RDMAVM_TIMEOUT, RDMAVM_MEM and RDMAVM_SMP must be integers" >&2; exit 2 ;; esac
done
[ -r "$GUEST_INIT" ] || { echo "rdma-vm: missing $GUEST_INIT" >&2; exit 2; }
mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock -w 1800 9 || { echo "rdma-vm: $DIR is locked by another run" >&2; exit 1; }

BINS= names=" "
for b in ${RDMAVM_BINS:-}; do
    [ -f "$b" ] && [ -x "$b" ] || die "RDMAVM_BINS: $b is not an executable file"
    n=$(basename "$b")
    case $names in *" $n "*) die "RDMAVM_BINS: two binaries named $n" ;; esac
    BINS="$BINS $b" names="$names$n "
done

T_START=$(date +%s.%N)
T_STEP=$T_START
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
# step NAME: print how long the previous step took, then start NAME
step() {
    [ -z "${STEP_NAME:-}" ] || echo "== $STEP_NAME: $(elapsed "$T_STEP") s"
    STEP_NAME=$1; T_STEP=$(date +%s.%N)
}

# ---------------------------------------------------------------- host packages
step "host packages"
PKGS="qemu-system-x86 kmod busybox-static rdma-core ibverbs-providers ibverbs-utils perftest
      iproute2 cpio gzip libibverbs-dev libnl-3-dev libnl-route-3-dev"
missing=
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
APT="apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3"
apt_updated=
apt_update() { [ -n "$apt_updated" ] || { $APT update -qq >"$DIR/apt.log" 2>&1 || { cat "$DIR/apt.log"; die "apt-get update"; }; apt_updated=1; }; }
if [ -n "$missing" ]; then
    echo "== installing:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt_update
    # shellcheck disable=SC2086
    $APT install -y -qq --no-install-recommends $missing >"$DIR/apt.log" 2>&1 ||
        { cat "$DIR/apt.log"; die "apt-get install$missing"; }
fi

# ---------------------------------------------------------------- kernel (cached)
step "kernel"
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }'; }
KPKG=$(kernel_pkg)
if [ -z "$KPKG" ]; then apt_update; KPKG=$(kernel_pkg); fi
[ -n "$KPKG" ] || die "cannot resolve linux-image-amd64 to a kernel package"
KV=${KPKG#linux-image-}
KROOT=$DIR/kernel-$KV
if [ ! -e "$KROOT/.complete" ]; then
    echo "== fetching $KPKG (apt-get download + dpkg -x; not installed on the host)"
    rm -rf "$KROOT" "$DIR/deb"; mkdir -p "$DIR/deb"
    if ! (cd "$DIR/deb" && apt-get download "$KPKG" >"$DIR/apt.log" 2>&1); then
        apt_update   # stale lists name a version the mirror no longer has
        KPKG=$(kernel_pkg); KV=${KPKG#linux-image-}; KROOT=$DIR/kernel-$KV; rm -rf "$KROOT"
        (cd "$DIR/deb" && apt-get download "$KPKG" >"$DIR/apt.log" 2>&1) || { cat "$DIR/apt.log"; die "apt-get download $KPKG"; }
    fi
    rm -rf "$KROOT.tmp"; dpkg -x "$DIR"/deb/*.deb "$KROOT.tmp"
    depmod -b "$KROOT.tmp" "$KV"
    rm -rf "$DIR/deb"
    touch "$KROOT.tmp/.complete"; mv "$KROOT.tmp" "$KROOT"
    for old in "$DIR"/kernel-*; do [ "$old" = "$KROOT" ] || rm -rf "$old"; done   # ~400 MB each
fi
VMLINUZ=$KROOT/boot/vmlinuz-$KV
[ -r "$VMLINUZ" ] || die "no $VMLINUZ in the cached kernel tree (rm -rf $KROOT and rerun)"
echo "== kernel $KV"

# ---------------------------------------------------------------- initramfs
step "initramfs"
R=$DIR/root
rm -rf "$R"
# merged-/usr layout, as on the host: /lib, /bin, ... point into /usr
mkdir -p "$R"/usr/{bin,sbin,lib,lib64} "$R"/{proc,sys,dev,tmp,run,root,etc,opt/gs/bin,rdmavm}
for d in bin sbin lib lib64; do ln -s "usr/$d" "$R/$d"; done
# put FILE (host path) at the same path in the guest
put() { mkdir -p "$R$(dirname "$1")"; cp -L "$1" "$R$1"; }

# kernel modules with their dependencies, a depmod'ed /lib/modules/$KV, so that busybox
# modprobe and the kernel's request_module() (rxe asks for "crypto-crc32") both work
MODULES="crc32_generic crc32_pclmul rdma_rxe ib_uverbs rdma_ucm veth dummy virtio_pci virtio_net"
echo "$MODULES" >"$R/rdmavm/modules"
for m in $MODULES; do
    modprobe -d "$KROOT" -S "$KV" --show-depends "$m" || die "module $m not in kernel $KV"
done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' | while read -r ko; do
    rel=${ko#"$KROOT"}; mkdir -p "$R$(dirname "$rel")"; cp "$ko" "$R$rel"
done
cp "$KROOT/lib/modules/$KV"/modules.{order,builtin,builtin.modinfo} "$R/lib/modules/$KV/"
depmod -b "$R" "$KV"

# userspace: the tools, the rxe provider (dlopen()ed, so ldd can't see it) and its config
TOOLS=
for t in ibv_devices ibv_devinfo ibv_rc_pingpong ib_write_bw ib_write_lat ib_read_bw ib_read_lat \
         ib_send_bw ib_send_lat rdma ip; do
    p=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v "$t") || die "$t not found on the host"
    put "$p"; TOOLS="$TOOLS $p"
done
# iproute2's ip at a fixed path (a bare `ip` in busybox ash is the applet anyway)
[ -e "$R/usr/sbin/ip" ] || ln -s "$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v ip)" "$R/usr/sbin/ip"
PROVIDER=$(dpkg -L ibverbs-providers | grep '/librxe-rdmav[0-9]*\.so$' | head -1)
[ -n "$PROVIDER" ] || die "no librxe provider in ibverbs-providers"
put "$PROVIDER"; put /etc/libibverbs.d/rxe.driver

# the caller's binaries, keeping their basenames
for b in $BINS; do cp -L "$b" "$R/opt/gs/bin/"; done

# shared libraries of all of them (static binaries: ldd lists nothing, which is fine)
# shellcheck disable=SC2086
for f in $TOOLS $PROVIDER $BINS; do ldd "$f" 2>/dev/null || true; done |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u |
    while read -r lib; do put "$lib"; done

# busybox: sh, mount, modprobe (the kernel's /sbin/modprobe), nc, ... as links; real tools win
cp -L /bin/busybox "$R/usr/bin/busybox"
for a in $(/bin/busybox --list-full); do
    [ -e "$R/$a" ] || [ -L "$R/$a" ] || { mkdir -p "$R/$(dirname "$a")"; ln -s /usr/bin/busybox "$R/$a"; }
done

cat >"$R/etc/hosts" <<'EOF'
127.0.0.1 localhost
10.77.0.1 rdmavm-server rdmavm-single
10.77.0.2 rdmavm-client
EOF
echo 'hosts: files dns' >"$R/etc/nsswitch.conf"
echo 'root:x:0:0:root:/root:/bin/sh' >"$R/etc/passwd"
echo 'root:x:0:' >"$R/etc/group"
: >"$R/etc/resolv.conf"

cp "$GUEST_INIT" "$R/init"; chmod 755 "$R/init"
printf '%s\n' "${RDMAVM_SINGLE_CMD:-ibv_devinfo -d rxe0}" >"$R/rdmavm/single.cmd"
printf '%s\n' "${RDMAVM_SERVER_CMD:-ibv_devinfo -d rxe0}" >"$R/rdmavm/server.cmd"
printf '%s\n' "${RDMAVM_CLIENT_CMD:-ping -c 3 \$RDMAVM_PEER_IP}" >"$R/rdmavm/client.cmd"

(cd "$R" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -1 >"$DIR/initrd.img.tmp")
mv "$DIR/initrd.img.tmp" "$DIR/initrd.img"
echo "== initramfs $(du -h "$DIR/initrd.img" | cut -f1) ($(du -sh "$R" | cut -f1) unpacked), binaries:${BINS:- none}"

# ---------------------------------------------------------------- boot
step "boot"
ACCEL=${RDMAVM_ACCEL:-}
if [ -z "$ACCEL" ]; then
    # kvm_pvm (this project's dev machines) is KVM without VT-x/SVM: a stock Debian kernel
    # barely moves under it, while TCG boots it in seconds
    if [ -d /sys/module/kvm_pvm ]; then ACCEL=tcg
    elif [ -r /dev/kvm ] && [ -w /dev/kvm ]; then ACCEL=kvm
    else ACCEL=tcg; fi
fi
case $ACCEL in
    # -arch-capabilities: qemu 7.2 aborts on some nested KVMs ("failed to set MSR 0x10a")
    kvm) QACCEL=(-accel kvm -cpu host,-arch-capabilities) ;;
    tcg) QACCEL=(-accel tcg,thread=multi -cpu max) ;;
    *) die "RDMAVM_ACCEL must be kvm or tcg, not $ACCEL" ;;
esac
echo "== accel $ACCEL, ${MEM} MiB, $SMP vCPUs per VM, timeout $TIMEOUT s per VM"

QEMU_PIDS=()
SOCKDIR=
cleanup() {
    for pf in "${QEMU_PIDS[@]}"; do
        [ -s "$pf" ] && kill "$(cat "$pf")" 2>/dev/null || true
    done
    [ -z "$SOCKDIR" ] || rm -rf "$SOCKDIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# vm ROLE [qemu args...]: boot one guest; its console goes, \r stripped, to $DIR/ROLE.log and,
# prefixed, to stdout. Writes qemu's exit status (124: timed out) to $DIR/ROLE.rc.
vm() {
    local role=$1; shift
    local log=$DIR/$role.log
    rm -f "$log" "$DIR/$role.rc" "$DIR/$role.pid"
    set +e
    timeout -k 10 "$TIMEOUT" qemu-system-x86_64 "${QACCEL[@]}" -m "$MEM" -smp "$SMP" \
        -nodefaults -no-user-config -display none -monitor none -serial stdio -no-reboot \
        -pidfile "$DIR/$role.pid" -kernel "$VMLINUZ" -initrd "$DIR/initrd.img" \
        -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off rdmavm_role=$role" \
        "$@" </dev/null 2>&1 | sed -u 's/\r//g' | tee "$log" | sed -u "s/^/[$role] /"
    echo "${PIPESTATUS[0]}" >"$DIR/$role.rc"
    set -e
}

# verdict ROLE: print one line; return 0 if the VM passed and finished
verdict() {
    local role=$1 log=$DIR/$1.log rc why
    rc=$(cat "$DIR/$role.rc" 2>/dev/null || echo '?')
    if grep -q '^RDMAVM: PASS guest command' "$log" && grep -q '^RDMAVM: done' "$log"; then
        echo "rdma-vm: PASS [$role] $(grep -o 'guest command took .*' "$log" | tail -1)"
        return 0
    fi
    if [ -e "$DIR/$role.stopped" ]; then why="stopped $PEER_GRACE s after the other VM failed"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why="guest did not finish within $TIMEOUT s"
    elif why=$(grep -m1 -o '^RDMAVM: FAIL .*' "$log"); then why=${why#RDMAVM: FAIL }
    elif ! grep -q '^RDMAVM: booted' "$log"; then why="guest never reached /init (qemu exit status $rc)"
    elif grep -q '^RDMAVM: PASS guest command' "$log"; then why="guest passed but did not power off cleanly (qemu exit status $rc)"
    else why="guest stopped without a verdict (kernel panic? qemu exit status $rc)"; fi
    echo "rdma-vm: FAIL [$role] $why (console: $log)"
    return 1
}

# failed ROLE: the VM has printed a FAIL marker, or its qemu has ended without a PASS
failed() {
    grep -q '^RDMAVM: FAIL' "$DIR/$1.log" 2>/dev/null && return 0
    [ -e "$DIR/$1.rc" ] && ! grep -q '^RDMAVM: PASS guest command' "$DIR/$1.log" 2>/dev/null
}

# clear every verdict file of an earlier run here, before any VM starts: a VM started in the
# background clears its own only once it runs, and the watcher below must not read stale ones
rm -f "$DIR"/*.stopped "$DIR"/{single,server,client}.{rc,log,pid}
if [ "$MODE" = single ]; then
    QEMU_PIDS=("$DIR/single.pid")
    vm single -nic none
    ROLES="single"
else
    SOCKDIR=$(mktemp -d /tmp/rdmavm-wire.XXXXXX)   # short path: unix sockets allow ~107 bytes
    SOCK=$SOCKDIR/wire.sock
    QEMU_PIDS=("$DIR/server.pid" "$DIR/client.pid")
    vm server -netdev "stream,id=n0,server=on,addr.type=unix,addr.path=$SOCK" \
        -device virtio-net-pci,netdev=n0,mac=52:54:00:77:00:01 &
    SERVER_JOB=$!
    # qemu's stream client does not retry: start it once the server listens (don't probe the
    # socket: the server takes exactly one peer)
    for _ in $(seq 300); do [ -S "$SOCK" ] && break; kill -0 $SERVER_JOB 2>/dev/null || break; sleep 0.1; done
    [ -S "$SOCK" ] || { wait $SERVER_JOB || true; verdict server || true; die "VM server did not open the wire $SOCK"; }
    vm client -netdev "stream,id=n0,server=off,addr.type=unix,addr.path=$SOCK" \
        -device virtio-net-pci,netdev=n0,mac=52:54:00:77:00:02 &
    CLIENT_JOB=$!
    # when one VM has failed, the other is likely to wait for it forever: give it a grace period
    fail_seen=
    while kill -0 $SERVER_JOB 2>/dev/null || kill -0 $CLIENT_JOB 2>/dev/null; do
        if [ -z "$fail_seen" ]; then
            for r in server client; do
                if failed $r; then fail_seen=$(date +%s); fi
            done
        elif [ $(( $(date +%s) - fail_seen )) -ge $PEER_GRACE ]; then
            for r in server client; do
                if [ ! -e "$DIR/$r.rc" ] && [ -s "$DIR/$r.pid" ]; then
                    touch "$DIR/$r.stopped"; kill "$(cat "$DIR/$r.pid")" 2>/dev/null || true
                fi
            done
        fi
        sleep 1
    done
    wait $SERVER_JOB $CLIENT_JOB || true
    ROLES="server client"
fi
step ""

status=0
for r in $ROLES; do verdict "$r" || status=1; done
echo "== total $(elapsed "$T_START") s"
exit $status
