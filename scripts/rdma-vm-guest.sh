#!/bin/busybox sh
# /init of the throw-away guests that scripts/rdma-vm.sh boots (busybox sh, PID 1).
# Not meant to run on a host: rdma-vm.sh copies it into the initramfs as /init.
#
# Reads its role (single|server|client) from the kernel command line
# (rdmavm_role=...), the command to run from /rdmavm/<role>.cmd, sets up
# mounts, modules, the netdev and the Soft-RoCE device rxe0, runs the command
# with `sh -c`, prints the verdict markers that the host greps for, and powers
# off. Markers (each on its own line, on the serial console):
#   RDMAVM: booted ...                      reached /init
#   RDMAVM: FAIL setup: <why>               setup failed; the command did not run
#   RDMAVM: PASS guest command              the command exited 0
#   RDMAVM: FAIL guest command (rc=N)       it exited N
#   RDMAVM: done                            last line before poweroff
PATH=/opt/gs/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH HOME=/root TERM=dumb LANG=C.UTF-8

/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1

up() { cut -d' ' -f1 /proc/uptime; }
say() { echo "RDMAVM: $*"; }
finish() { say "done uptime=$(up)s"; sync; poweroff -f; sleep 30; exit 1; }
setup_fail() { say "FAIL setup: $*"; finish; }

say "booted uptime=$(up)s kernel=$(uname -r)"
role=$(sed -n 's/.*rdmavm_role=\([a-z]*\).*/\1/p' /proc/cmdline)

# --- file systems: /dev/shm is where gradsync's shared-memory segments live
mkdir -p /dev/pts /dev/shm /tmp /run /root
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777,size=80% tmpfs /dev/shm
mount -t tmpfs -o mode=1777,size=80% tmpfs /tmp
mount -t tmpfs -o mode=0755 tmpfs /run
ln -sf /proc/self/fd /dev/fd
ln -sf /proc/self/fd/0 /dev/stdin
ln -sf /proc/self/fd/1 /dev/stdout
ln -sf /proc/self/fd/2 /dev/stderr
hostname "rdmavm-$role"

# --- `retry`, for guest commands (a script, not a function, so that `sh -c` commands and
# programs can use it)
mkdir -p /usr/local/bin
cat >/usr/local/bin/retry <<'END'
#!/bin/sh
# retry [-n TRIES] [-s SECONDS] CMD [ARGS...]: rerun CMD until it exits 0 (default 60 tries, 1 s apart)
n=60 s=1
while :; do case $1 in -n) n=$2; shift 2 ;; -s) s=$2; shift 2 ;; *) break ;; esac; done
i=1
until "$@"; do
    [ "$i" -ge "$n" ] && { echo "retry: giving up after $n tries: $*" >&2; exit 1; }
    i=$((i + 1)); sleep "$s"
done
END
chmod +x /usr/local/bin/retry

# --- kernel modules (rdma_rxe pulls crc32 through request_module -> /sbin/modprobe)
for m in $(cat /rdmavm/modules); do
    modprobe "$m" || setup_fail "modprobe $m"
done

# --- network
ip link set lo up
case $role in
    single) DEV=dummy0 MYIP=10.77.0.1 PEER=
            # `modprobe dummy` normally creates dummy0 already
            [ -e /sys/class/net/dummy0 ] || ip link add dummy0 type dummy ;;
    server) DEV=eth0 MYIP=10.77.0.1 PEER=10.77.0.2 ;;
    client) DEV=eth0 MYIP=10.77.0.2 PEER=10.77.0.1 ;;
    *) setup_fail "unknown role '$role' (kernel command line: $(cat /proc/cmdline))" ;;
esac
[ -e /sys/class/net/$DEV ] || setup_fail "no netdev $DEV ($(ls /sys/class/net | tr '\n' ' '))"
ip link set "$DEV" mtu 9000 || setup_fail "mtu 9000 on $DEV"
ip link set "$DEV" up || setup_fail "link up $DEV"
ip addr add "$MYIP/24" dev "$DEV" || setup_fail "address $MYIP on $DEV"

# --- Soft-RoCE
rdma link add rxe0 type rxe netdev "$DEV" || setup_fail "rdma link add rxe0 type rxe netdev $DEV ($(dmesg | grep -i rxe | tail -3))"

# GID index of the RoCE v2, IPv4-mapped GID of $MYIP, from `ibv_devinfo -v`. Depending on
# the rdma-core version the GID is printed as ::ffff:10.77.0.1 or as 8 hex groups.
hexip=$(echo "$MYIP" | awk -F. '{printf "%02x%02x:%02x%02x", $1, $2, $3, $4}')
GIDX= tries=0
while :; do
    ibv_devinfo -v -d rxe0 >/tmp/.rdmavm-devinfo 2>&1
    GIDX=$(awk -v ip="$MYIP" -v hex="$hexip" '
        /GID\[/ && /RoCE v2/ && (index($0, "::ffff:" ip ",") || index($0, "0000:0000:0000:0000:0000:ffff:" hex ",")) {
            s = $0; sub(/.*GID\[ */, "", s); sub(/\].*/, "", s); print s; exit }' /tmp/.rdmavm-devinfo)
    [ -n "$GIDX" ] && grep -q PORT_ACTIVE /tmp/.rdmavm-devinfo && break
    tries=$((tries + 1))
    if [ $tries -ge 50 ]; then
        cat /tmp/.rdmavm-devinfo
        setup_fail "rxe0: no active port with a RoCE v2 GID for $MYIP after 10 s"
    fi
    sleep 0.2
done
say "rxe0 on $DEV ($MYIP): port active, RoCE v2 GID index $GIDX, $(grep -o 'active_mtu:.*' /tmp/.rdmavm-devinfo | head -1 | tr -s '\t ' ' ')"

# --- the command
export RDMAVM_ROLE=$role RDMAVM_IP=$MYIP RDMAVM_DEV=$DEV RDMAVM_GID_INDEX=$GIDX
[ -n "$PEER" ] && export RDMAVM_PEER_IP=$PEER
cmd=$(cat "/rdmavm/$role.cmd")
say "setup done uptime=$(up)s; running: $cmd"
cd /root
t0=$(up)
sh -c "$cmd" </dev/null
rc=$?
t1=$(up)
say "guest command took $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')s"
if [ $rc -eq 0 ]; then say "PASS guest command"; else say "FAIL guest command (rc=$rc)"; fi
finish
