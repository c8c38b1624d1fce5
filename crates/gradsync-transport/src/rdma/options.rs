//! Options of the RDMA backend ([`RdmaOptions`]) and their defaults.

/// Default queue pairs per peer (`GRADSYNC_IB_QPS_PER_CONN`).
pub const DEFAULT_QPS_PER_PEER: usize = 2;
/// Default local ACK timeout exponent (`GRADSYNC_IB_TIMEOUT`): 4.096 µs x 2^18, about 1 s.
pub const DEFAULT_IB_TIMEOUT: u8 = 18;
/// Default transport retry count (`GRADSYNC_IB_RETRY_CNT`).
pub const DEFAULT_RETRY_CNT: u8 = 7;
/// Default size of the staging ring that caller data is copied into before a write.
pub const DEFAULT_STAGING: usize = 32 << 20;
/// Default bound on the bytes registered with the adapter.
pub const DEFAULT_REG_MAX: usize = 4 << 30;

/// Options of the RDMA backend.
#[derive(Clone, Debug)]
pub struct RdmaOptions {
    /// Device and optional port, `mlx5_0` or `mlx5_0:1` (`GRADSYNC_IB_HCA`); `None` picks the
    /// first active port.
    pub hca: Option<String>,
    /// GID index (`GRADSYNC_IB_GID_INDEX`); `None` picks one (RoCE v2 with an IPv4 address
    /// first).
    pub gid_index: Option<u32>,
    /// Queue pairs per peer (`GRADSYNC_IB_QPS_PER_CONN`, at least 1).
    pub qps_per_peer: usize,
    /// Local ACK timeout exponent (`GRADSYNC_IB_TIMEOUT`, 1..=31).
    pub ib_timeout: u8,
    /// Transport retries before a write fails (`GRADSYNC_IB_RETRY_CNT`, 0..=7).
    pub retry_cnt: u8,
    /// Bytes of the staging ring for data from unpinned memory.
    pub staging_bytes: usize,
    /// Bound on the bytes registered with the adapter.
    pub reg_max_bytes: usize,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            hca: None,
            gid_index: None,
            qps_per_peer: DEFAULT_QPS_PER_PEER,
            ib_timeout: DEFAULT_IB_TIMEOUT,
            retry_cnt: DEFAULT_RETRY_CNT,
            staging_bytes: DEFAULT_STAGING,
            reg_max_bytes: DEFAULT_REG_MAX,
        }
    }
}
