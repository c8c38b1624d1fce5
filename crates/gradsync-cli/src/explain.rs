//! `gradsync bench --explain`: the alpha-beta cost model next to what was measured.
//!
//! Before the sweep, ranks 0 and 1 calibrate a link model over the transport they share: the
//! one-way latency `alpha` from 8-byte ping-pongs and the bandwidth from 4 MiB messages (about
//! 50 ms on loopback). With `GRADSYNC_COST_FILE=PATH` the model is read from that file when it
//! exists (pinned: nothing is measured) and written there otherwise, so it can be inspected,
//! edited and reused. After the table, rank 0 prints for every all-reduce row the time the
//! simulator predicts for every algorithm under that model (`gradsync_core::sim::predict`, the
//! schedules' own message pattern), the model's best, the algorithm the automatic choice ran,
//! and the measured time.

use std::time::Instant;

use anyhow::{Context, ensure};
use gradsync::{Algorithm, Collective, Communicator, DataType};

use crate::table::Row;

pub use gradsync::cost::CostModel;

const PINGS: usize = 200;
const BIG: usize = 4 << 20;
const BIGS: usize = 4;

/// Measures the model between ranks 0 and 1, or reads it from `GRADSYNC_COST_FILE`; every rank
/// returns the same model and where it came from.
pub fn calibrate(comm: &mut Communicator) -> anyhow::Result<(CostModel, String)> {
    let file = std::env::var_os("GRADSYNC_COST_FILE").map(std::path::PathBuf::from);
    if let Some(path) = file.as_ref().filter(|p| p.exists()) {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read GRADSYNC_COST_FILE {}", path.display()))?;
        let m: CostModel = serde_json::from_str(&text).with_context(|| {
            format!("GRADSYNC_COST_FILE {} is not a cost model", path.display())
        })?;
        ensure!(
            m.alpha_us >= 0.0 && m.gbytes_per_s > 0.0,
            "GRADSYNC_COST_FILE {}: alpha_us must be >= 0 and gbytes_per_s > 0",
            path.display()
        );
        return Ok((m, format!("pinned in {}", path.display())));
    }
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut vals = [0f64; 2];
    if world >= 2 && rank < 2 {
        let other = 1 - rank;
        let mut small = [0u8; 8];
        let ping = |comm: &mut Communicator, small: &mut [u8; 8]| -> anyhow::Result<()> {
            if rank == 0 {
                comm.send(&small[..], other)?;
                comm.recv(&mut small[..], other)?;
            } else {
                comm.recv(&mut small[..], other)?;
                comm.send(&small[..], other)?;
            }
            Ok(())
        };
        for _ in 0..20 {
            ping(comm, &mut small)?;
        }
        let t = Instant::now();
        for _ in 0..PINGS {
            ping(comm, &mut small)?;
        }
        let alpha = t.elapsed().as_secs_f64() / (2 * PINGS) as f64;
        let mut big = vec![0u8; BIG];
        let mut ack = [0u8; 1];
        let t = Instant::now();
        for _ in 0..BIGS {
            if rank == 0 {
                comm.send(&big, other)?;
            } else {
                comm.recv(&mut big, other)?;
            }
        }
        if rank == 0 {
            comm.recv(&mut ack, other)?;
        } else {
            comm.send(&ack, other)?;
        }
        let secs = (t.elapsed().as_secs_f64() - (BIGS + 1) as f64 * alpha).max(1e-9);
        vals = [alpha * 1e6, (BIGS * BIG) as f64 / secs / 1e9];
    }
    comm.broadcast(&mut vals, 0)?;
    let transport = if world >= 2 {
        comm.peer_transport(if rank == 0 { 1 } else { 0 })
            .to_string()
    } else {
        "self".to_string()
    };
    let m = CostModel {
        transport,
        alpha_us: vals[0],
        gbytes_per_s: vals[1],
    };
    let mut from = "measured between ranks 0 and 1".to_string();
    if let Some(path) = &file
        && rank == 0
    {
        std::fs::write(path, serde_json::to_string_pretty(&m)? + "\n")
            .with_context(|| format!("cannot write GRADSYNC_COST_FILE {}", path.display()))?;
        from += &format!(", saved to {}", path.display());
    }
    Ok((m, from))
}

/// Predicted seconds of an all-reduce of `bytes` bytes of `dtype` with `algo` (`None`: eager)
/// under `model`, on every link alike.
fn predicted(
    comm: &Communicator,
    model: &CostModel,
    dtype: DataType,
    bytes: u64,
    algo: Option<Algorithm>,
) -> anyhow::Result<f64> {
    let link = model.link();
    gradsync::cost::predict_all_reduce(
        comm.world_size(),
        comm.local_size(),
        comm.segment_elems(dtype),
        dtype,
        bytes as usize,
        algo,
        &link,
        &link,
    )
    .map_err(|e| anyhow::anyhow!(e))
}

/// The `--explain` section for the measured `rows` (rank 0 prints it).
pub fn render(
    comm: &Communicator,
    model: &CostModel,
    from: &str,
    rows: &[(DataType, Row)],
) -> anyhow::Result<String> {
    let algos = gradsync::cost::all_reduce_candidates(comm.world_size(), comm.local_size());
    let mut s = format!(
        "#\n# explain: alpha-beta model ({from}): {} alpha {:.2} us, {:.3} GB/s per link\n",
        model.transport, model.alpha_us, model.gbytes_per_s
    );
    s += "# predicted time (us) of every all-reduce algorithm under the model, the model's best, the automatic choice and the measured out-of-place time\n";
    s += &format!("# {:>12} {:>10}", "size", "eager");
    for a in &algos {
        s += &format!(" {:>18}", a.name());
    }
    s += &format!(
        " {:>18} {:>18} {:>12}\n",
        "model best", "auto ran", "measured"
    );
    for (dtype, row) in rows.iter().filter(|(_, r)| r.collective == "all_reduce") {
        let auto = comm.algorithm_for(Collective::AllReduce, row.size as usize);
        let mut best: (f64, &str) = (f64::INFINITY, "");
        let eager = if auto.is_none() {
            let t = predicted(comm, model, *dtype, row.size, None)?;
            best = (t, "eager");
            format!("{:>10.1}", t * 1e6)
        } else {
            format!("{:>10}", "-")
        };
        s += &format!("# {:>12} {eager}", row.size);
        for &a in &algos {
            let t = predicted(comm, model, *dtype, row.size, Some(a))?;
            if t < best.0 {
                best = (t, a.name());
            }
            s += &format!(" {:>18.1}", t * 1e6);
        }
        let measured = row
            .out_of_place
            .map_or("-".to_string(), |m| format!("{:.1}", m.time_us));
        s += &format!(
            " {:>18} {:>18} {:>12}\n",
            best.1,
            auto.map_or("eager", Algorithm::name),
            measured
        );
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_model_round_trips_through_its_file_format() {
        let m = CostModel {
            transport: "shm".into(),
            alpha_us: 1.5,
            gbytes_per_s: 3.25,
        };
        let text = serde_json::to_string_pretty(&m).unwrap();
        assert_eq!(serde_json::from_str::<CostModel>(&text).unwrap(), m);
        let l = m.link();
        assert!((l.message_s(0) - 1.5e-6).abs() < 1e-12);
        assert!((l.message_s(3_250_000_000) - (1.5e-6 + 1.0)).abs() < 1e-9);
    }
}
