//! Declarations of `shim.c`, the flat C layer over libibverbs.

use std::ffi::{c_char, c_int, c_void};

/// Opaque `struct gs_dev` (context, protection domain, completion channel and queue).
#[repr(C)]
pub struct GsDev {
    _p: [u8; 0],
}

/// Opaque `struct ibv_mr`.
#[repr(C)]
pub struct IbvMr {
    _p: [u8; 0],
}

/// Opaque `struct ibv_qp`.
#[repr(C)]
pub struct IbvQp {
    _p: [u8; 0],
}

/// `struct gs_port`: one port of one device.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct GsPort {
    pub dev: [c_char; 64],
    pub node_guid: u64,
    pub fw_ver: [c_char; 64],
    pub port: u32,
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub link_layer: u32,
    pub lid: u32,
    pub gid_tbl_len: u32,
    pub active_speed: u32,
    pub active_width: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cqe: u32,
}

impl Default for GsPort {
    fn default() -> Self {
        GsPort {
            dev: [0; 64],
            node_guid: 0,
            fw_ver: [0; 64],
            port: 0,
            state: 0,
            max_mtu: 0,
            active_mtu: 0,
            link_layer: 0,
            lid: 0,
            gid_tbl_len: 0,
            active_speed: 0,
            active_width: 0,
            max_qp_wr: 0,
            max_sge: 0,
            max_cqe: 0,
        }
    }
}

/// `struct gs_gid`: one GID table entry of one port.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct GsGid {
    pub dev: [c_char; 64],
    pub gid: [u8; 16],
    pub index: u32,
    pub port: u32,
    pub typ: u32,
    pub pad: u32,
}

impl Default for GsGid {
    fn default() -> Self {
        GsGid {
            dev: [0; 64],
            gid: [0; 16],
            index: 0,
            port: 0,
            typ: 0,
            pad: 0,
        }
    }
}

/// `struct gs_wc`: one work completion.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GsWc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub byte_len: u32,
    pub imm: u32,
    pub qp_num: u32,
    pub vendor_err: u32,
    pub with_imm: u32,
    pub pad: u32,
}

unsafe extern "C" {
    pub fn gs_list_ports(out: *mut GsPort, max: c_int) -> c_int;
    pub fn gs_open(name: *const c_char, port: u32, cqe: c_int, err: *mut c_int) -> *mut GsDev;
    pub fn gs_resize_cq(d: *mut GsDev, cqe: c_int) -> c_int;
    pub fn gs_cq_size(d: *mut GsDev) -> c_int;
    pub fn gs_port_info(d: *mut GsDev, out: *mut GsPort) -> c_int;
    pub fn gs_gid(d: *mut GsDev, idx: u32, gid: *mut u8, typ: *mut u32) -> c_int;
    pub fn gs_list_gids(out: *mut GsGid, max: c_int) -> c_int;
    pub fn gs_close(d: *mut GsDev);
    pub fn gs_reg(
        d: *mut GsDev,
        addr: *mut c_void,
        len: usize,
        access: c_int,
        lkey: *mut u32,
        rkey: *mut u32,
        err: *mut c_int,
    ) -> *mut IbvMr;
    pub fn gs_dereg(mr: *mut IbvMr) -> c_int;
    pub fn gs_qp_create(
        d: *mut GsDev,
        max_send: u32,
        max_recv: u32,
        max_sge: u32,
        max_inline: u32,
        qpn: *mut u32,
        err: *mut c_int,
    ) -> *mut IbvQp;
    pub fn gs_qp_destroy(qp: *mut IbvQp) -> c_int;
    pub fn gs_qp_init(qp: *mut IbvQp, port: u32) -> c_int;
    pub fn gs_qp_rtr(
        qp: *mut IbvQp,
        port: u32,
        mtu: u32,
        dqpn: u32,
        rq_psn: u32,
        is_global: u32,
        dgid: *const u8,
        sgid_index: u32,
        dlid: u32,
    ) -> c_int;
    pub fn gs_qp_rts(
        qp: *mut IbvQp,
        sq_psn: u32,
        timeout: u32,
        retry_cnt: u32,
        rnr_retry: u32,
    ) -> c_int;
    pub fn gs_post_write(
        qp: *mut IbvQp,
        wr_id: u64,
        addr: *const u64,
        len: *const u32,
        lkey: *const u32,
        nsge: u32,
        raddr: u64,
        rkey: u32,
        with_imm: u32,
        imm: u32,
    ) -> c_int;
    pub fn gs_post_send(
        qp: *mut IbvQp,
        wr_id: u64,
        addr: u64,
        len: u32,
        lkey: u32,
        with_imm: u32,
        imm: u32,
    ) -> c_int;
    pub fn gs_post_recv(qp: *mut IbvQp, wr_id: u64, addr: u64, len: u32, lkey: u32) -> c_int;
    pub fn gs_poll(d: *mut GsDev, out: *mut GsWc, n: c_int) -> c_int;
    pub fn gs_req_notify(d: *mut GsDev) -> c_int;
    pub fn gs_channel_fd(d: *mut GsDev) -> c_int;
    pub fn gs_take_event(d: *mut GsDev) -> c_int;
    pub fn gs_wc_status_str(s: u32) -> *const c_char;
    #[cfg(test)]
    pub fn gs_wc_opcode(which: c_int) -> u32;
}
