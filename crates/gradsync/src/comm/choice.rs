//! Which algorithm a call runs: forced (`GRADSYNC_ALGO`, [`Communicator::set_algorithm`]) or
//! the cost model's fastest for the size class, the model in use, and the INFO line that
//! explains the choice.

use super::communicator::Communicator;
use crate::Result;
use gradsync_core::Collective;
use gradsync_core::schedule::plan::{self, Algorithm};

/// An empty cache of the model's choices: one slot per size class (`0..=usize::BITS`).
pub(super) fn no_choices() -> Box<[std::sync::OnceLock<crate::cost::Choice>]> {
    (0..=usize::BITS)
        .map(|_| std::sync::OnceLock::new())
        .collect()
}

impl Communicator {
    /// Whether all-reduces of `dtype` run the deterministic program of
    /// [`Config::deterministic`](crate::Config::deterministic) where an algorithm is chosen
    /// (floats; eager all-reduces already reduce in rank order).
    pub(super) fn deterministic(&self, dtype: gradsync_core::DataType) -> bool {
        self.engine.opts.deterministic && dtype.is_float()
    }

    /// Forces an all-reduce algorithm (`None` = automatic), as `GRADSYNC_ALGO` does. Fails for
    /// the algorithms the engine chooses itself ([`Algorithm::is_internal`]).
    pub fn set_algorithm(&mut self, algorithm: Option<Algorithm>) -> Result<()> {
        self.set_collective_algorithm(Collective::AllReduce, algorithm)
    }

    /// Forces the algorithm of collective `coll` (`None` = automatic), as
    /// `GRADSYNC_ALGO=COLL:ALGO` does. All-reduce is [`set_algorithm`](Self::set_algorithm)'s.
    /// Fails for an algorithm the collective does not have.
    pub fn set_collective_algorithm(
        &mut self,
        coll: Collective,
        algorithm: Option<Algorithm>,
    ) -> Result<()> {
        if let Some(a) = algorithm
            && a.is_internal()
        {
            return Err(self.invalid(
                coll.name(),
                format!(
                    "the {} algorithm is chosen by the engine and cannot be forced",
                    a.name()
                ),
            ));
        }
        if let Some(a) = algorithm
            && !plan::supports(coll, a)
        {
            return Err(self.invalid(coll.name(), format!("no {} algorithm", a.name())));
        }
        if coll == Collective::AllReduce {
            self.algorithm = algorithm;
            return Ok(());
        }
        self.coll_algorithms.retain(|(k, _)| *k != coll);
        if let Some(a) = algorithm {
            self.coll_algorithms.push((coll, a));
        }
        Ok(())
    }

    /// The schedule a call of `coll` on `bytes` bytes per rank runs: `None` for the eager path of
    /// a small all-reduce, else the algorithm as the flight recorder names it: forced by
    /// `GRADSYNC_ALGO`, or for an all-reduce the cost model's fastest for the size class of
    /// `bytes` ([`crate::cost::choose_all_reduce`]), for an all-to-all (`bytes` per block) the
    /// model's pairwise or Bruck ([`crate::cost::choose_all_to_all`]), or the default of the
    /// collective.
    pub fn algorithm_for(&self, coll: Collective, bytes: usize) -> Option<Algorithm> {
        if coll == Collective::AllReduce
            && self.algorithm.is_none()
            && self.engine.eager_fits(bytes)
        {
            return None;
        }
        Some(match (coll, self.algorithm) {
            (Collective::AllReduce, Some(a)) => a,
            (Collective::AllReduce, None)
                if (2..=crate::cost::MODEL_MAX_WORLD).contains(&self.world) =>
            {
                self.model_choice(bytes).best
            }
            (c, _) => match self.coll_algorithms.iter().find(|(k, _)| *k == c) {
                Some(&(_, a)) => a,
                None if c == Collective::AllToAll => {
                    let local = self.layout.local_size;
                    let link = if local > 0 && local < self.world {
                        self.costs.inter.link()
                    } else {
                        self.costs.intra.link()
                    };
                    let window = self.exchange_window(bytes);
                    crate::cost::choose_all_to_all(self.world, bytes, window, &link).0
                }
                None => plan::default_algorithm(coll, self.world, bytes),
            },
        })
    }

    /// The model's predictions and choice for the size class of `bytes`, computed once per class.
    pub fn model_choice(&self, bytes: usize) -> &crate::cost::Choice {
        let class = crate::cost::size_class(bytes);
        self.choices[class as usize].get_or_init(|| {
            crate::cost::choose_all_reduce(
                self.world,
                self.layout.local_size,
                self.engine.segment_elems(gradsync_core::DataType::F32),
                class,
                &self.costs,
                self.inter_slots(),
            )
        })
    }

    /// Logs at INFO (`COLL`, rank 0), once per power-of-two size class, the cost model's
    /// predicted time of every all-reduce algorithm for that class, its choice, and what this
    /// communicator runs (eager, or a forced algorithm, where those apply).
    pub(super) fn explain_choice(&mut self, bytes: usize) {
        let class = crate::cost::size_class(bytes);
        if self.explained & (1u64 << class.min(63)) != 0 || self.world < 2 || self.rank != 0 {
            return;
        }
        self.explained |= 1u64 << class.min(63);
        let runs = self.algorithm_for(Collective::AllReduce, bytes);
        let choice = self.model_choice(bytes);
        let mut line = String::new();
        if runs.is_none() {
            let (intra, inter) = (self.costs.intra.link(), self.costs.inter.link());
            let (world, local) = (self.world, self.layout.local_size);
            let seg = self.engine.segment_elems(gradsync_core::DataType::F32);
            let dt = gradsync_core::DataType::F32;
            if let Ok(t) = crate::cost::predict_all_reduce(
                world,
                local,
                seg,
                dt,
                crate::cost::class_bytes(class),
                None,
                &intra,
                &inter,
                self.inter_slots(),
            ) {
                line += &format!(" eager {:.1} us", t * 1e6);
            }
        }
        for (a, t) in &choice.predicted {
            match t {
                Ok(t) => line += &format!(" {a} {:.1} us", t * 1e6),
                Err(e) => line += &format!(" {a} ({e})"),
            }
        }
        let mut measured = String::new();
        if let Some(m) = &choice.measured {
            let runs = m.runs();
            let plural = if runs == 1 { "" } else { "s" };
            line += &format!(
                "; measured at {} bytes (median of {runs} run{plural}):",
                m.bytes
            );
            for (a, us) in m.medians() {
                line += &format!(" {a} {us:.1} us");
            }
            measured = format!(", measured choice {}", m.algorithm);
        }
        tracing::info!(
            target: "gradsync::coll",
            "rank {}: all_reduce of {bytes} bytes on {} ranks, predicted at {} bytes ({}):{line}; model's choice {}{measured}, runs {}",
            self.rank,
            self.world,
            crate::cost::class_bytes(class),
            self.cost_from,
            choice.model,
            runs.map_or("eager", Algorithm::name)
        );
    }

    /// The cost model of the automatic all-reduce choice, and where it came from (`pinned in
    /// PATH`, `cached in PATH`, `measured at init ...`, `uncalibrated`).
    pub fn cost_model(&self) -> (&crate::cost::LinkCosts, &str) {
        (&self.costs, &self.cost_from)
    }

    /// The file the cost model was read from or saved to (pinned in `GRADSYNC_COST_FILE` or
    /// the per-host cache); `None` when it is in no file.
    pub fn cost_file(&self) -> Option<&std::path::Path> {
        self.cost_path.as_deref()
    }

    /// Takes `links` as the cost model (from `from`, in file `path`), forgetting the choices of
    /// the previous one.
    pub(super) fn set_costs(
        &mut self,
        links: crate::cost::LinkCosts,
        from: String,
        path: Option<std::path::PathBuf>,
    ) {
        (self.costs, self.cost_from, self.cost_path) = (links, from, path);
        self.choices = no_choices();
    }
}
