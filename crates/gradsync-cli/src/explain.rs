//! `gradsync bench --explain`: the alpha-beta cost model next to what was measured.
//!
//! The model is the one the communicator settled at init (see `gradsync::cost`): pinned in
//! `GRADSYNC_COST_FILE`, read from the per-host cache, or measured between rank 0 and its
//! neighbours and cached. After the table, rank 0 prints for every all-reduce row the time the
//! simulator predicts for every algorithm under that model (`gradsync_core::sim::predict_on`,
//! the schedules' own message pattern), the model's best at that size, the algorithm the
//! automatic choice ran (the model's best for the size class, or eager), and the measured time.

use gradsync::{Algorithm, Collective, Communicator, DataType};

use crate::table::Row;

/// Predicted seconds of an all-reduce of `bytes` bytes of `dtype` with `algo` (`None`: eager)
/// under the communicator's model, with the proportions timed at init from
/// [`gradsync::cost::BULK_FROM`] on.
fn predicted(
    comm: &Communicator,
    dtype: DataType,
    bytes: u64,
    algo: Option<Algorithm>,
) -> anyhow::Result<f64> {
    let links = comm.cost_model().0;
    gradsync::cost::predict_all_reduce(
        comm.world_size(),
        comm.local_size(),
        comm.segment_elems(dtype),
        dtype,
        bytes as usize,
        algo,
        &links.intra.link(),
        &links.inter.link(),
        comm.inter_slots(),
    )
    .map(|t| match algo {
        Some(a) => {
            t * links.bulk_scale(
                comm.world_size(),
                comm.local_size(),
                comm.segment_elems(DataType::F32),
                comm.inter_slots(),
                a,
                bytes as usize,
            )
        }
        None => t,
    })
    .map_err(|e| anyhow::anyhow!(e))
}

/// The `--explain` section for the measured `rows` (rank 0 prints it).
pub fn render(comm: &Communicator, rows: &[(DataType, Row)]) -> anyhow::Result<String> {
    let algos = gradsync::cost::all_reduce_candidates(comm.world_size(), comm.local_size());
    let (links, from) = comm.cost_model();
    let mut s = format!(
        "#\n# explain: alpha-beta model ({from}): inside a host {} alpha {:.2} us, {:.3} GB/s; across hosts {} alpha {:.2} us, {:.3} GB/s\n",
        links.intra.transport,
        links.intra.alpha_us,
        links.intra.gbytes_per_s,
        links.inter.transport,
        links.inter.alpha_us,
        links.inter.gbytes_per_s
    );
    let timed: Vec<_> = links
        .bulk_of(comm.world_size(), comm.local_size())
        .collect();
    if !timed.is_empty() {
        s += "# candidates timed at init (us per call); between two timed sizes each prediction takes the proportion to the ring interpolated from theirs\n";
        for b in timed {
            s += &format!(
                "# {:>12}{}\n",
                b.bytes,
                b.us.iter()
                    .map(|(a, us)| format!(" {a} {us:.0}"))
                    .collect::<String>()
            );
        }
    }
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
            let t = predicted(comm, *dtype, row.size, None)?;
            best = (t, "eager");
            format!("{:>10.1}", t * 1e6)
        } else {
            format!("{:>10}", "-")
        };
        s += &format!("# {:>12} {eager}", row.size);
        for &a in &algos {
            let t = predicted(comm, *dtype, row.size, Some(a))?;
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
    use gradsync::cost::CostModel;

    #[test]
    fn cost_model_round_trips_through_its_file_format() {
        let m = CostModel {
            transport: "shm".into(),
            alpha_us: 1.5,
            gbytes_per_s: 3.25,
            others: None,
        };
        let text = serde_json::to_string_pretty(&m).unwrap();
        assert_eq!(serde_json::from_str::<CostModel>(&text).unwrap(), m);
        let l = m.link();
        assert!((l.message_s(0) - 1.5e-6).abs() < 1e-12);
        assert!((l.message_s(3_250_000_000) - (1.5e-6 + 1.0)).abs() < 1e-9);
    }
}
