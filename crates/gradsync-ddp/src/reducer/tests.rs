use super::*;
use gradsync::Config;

fn comm1() -> Communicator {
    Communicator::mem_group(1, &Config::new("unused:0", 0, 1))
        .unwrap()
        .remove(0)
}

#[test]
fn buckets_fill_in_reverse_registration_order() {
    // 10, 20, 30, 40 elements; a cap of 60 elements.
    let b = assign_buckets(&[10, 20, 30, 40], 60 * 4);
    assert_eq!(b, vec![vec![3], vec![2, 1, 0]]);
    // One bucket when everything fits, still last parameter first.
    assert_eq!(assign_buckets(&[1, 2, 3], 1 << 20), vec![vec![2, 1, 0]]);
    // A parameter above the cap gets a bucket of its own; none is empty.
    assert_eq!(
        assign_buckets(&[5, 100, 5, 5], 12 * 4),
        vec![vec![3, 2], vec![1], vec![0]]
    );
    // A cap below one element still makes one bucket per parameter.
    assert_eq!(assign_buckets(&[1, 1], 1), vec![vec![1], vec![0]]);
    assert!(assign_buckets(&[], 100).is_empty());
}

#[test]
fn reducer_lays_parameters_out_by_bucket() {
    let r = Reducer::new(&[10, 20, 30, 40], 60 * 4).unwrap();
    assert_eq!(r.num_buckets(), 2);
    assert_eq!(r.bucket_params(0), &[3]);
    assert_eq!(r.bucket_params(1), &[2, 1, 0]);
    assert_eq!(
        (0..4).map(|p| r.bucket_of(p)).collect::<Vec<_>>(),
        vec![1, 1, 1, 0]
    );
    assert_eq!(r.num_elements(), 100);
    let off: Vec<(usize, usize)> = r.slots.iter().map(|s| (s.offset, s.len)).collect();
    assert_eq!(off, vec![(50, 10), (30, 20), (0, 30), (0, 40)]);
    assert!(Reducer::new(&[1, 0], 1024).is_err());
    assert!(Reducer::new(&[1], 3).is_err());
}

#[test]
fn bucket_sizes_parse() {
    assert_eq!(bucket_cap_bytes(25.0).unwrap(), 25 << 20);
    assert_eq!(bucket_cap_bytes(0.25).unwrap(), 1 << 18);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-9] {
        assert!(bucket_cap_bytes(bad).is_err(), "{bad}");
    }
}

#[test]
fn accumulation_sums_micro_batches_and_divides_once() {
    let mut c = comm1();
    let mut r = Reducer::new(&[3, 2], 8).unwrap(); // two buckets
    assert_eq!(r.num_buckets(), 2);
    r.begin_step(3).unwrap();
    let mut g0 = vec![0.0f32; 3];
    let mut g1 = vec![0.0f32; 2];
    for micro in 0..3 {
        assert_eq!(r.micro_batch(), micro);
        assert_eq!(r.is_sync_micro_batch(), micro == 2);
        let m = micro as f32;
        g1.copy_from_slice(&[1.0 + m, 10.0 * m]);
        r.mark_ready(&mut c, 1, &g1).unwrap();
        // The caller's buffer is its own: overwriting it does not touch the accumulation.
        g1.fill(f32::NAN);
        g0.copy_from_slice(&[m, -m, 0.5]);
        r.mark_ready(&mut c, 0, &g0).unwrap();
        g0.fill(f32::NAN);
    }
    let g = r.finish(&mut c).unwrap();
    assert_eq!(g.len(), 2);
    // Sums: [0+1+2, -(0+1+2), 1.5] and [1+2+3, 0+10+20]; divided by world 1 x K 3.
    assert_eq!(g.get(0), &[1.0, -1.0, 0.5]);
    assert_eq!(g.get(1), &[2.0, 10.0]);
    assert_eq!(g.stats().buckets, 2);
    assert_eq!(g.stats().bytes, 20);
    assert_eq!(g.stats().world, 1);

    // The next step starts from zero, not from the previous result.
    r.begin_step(1).unwrap();
    r.mark_ready(&mut c, 0, &[4.0, 4.0, 4.0]).unwrap();
    r.mark_ready(&mut c, 1, &[5.0, 6.0]).unwrap();
    let g = r.finish(&mut c).unwrap();
    assert_eq!(
        g.iter().collect::<Vec<_>>(),
        vec![&[4.0f32, 4.0, 4.0][..], &[5.0, 6.0][..]]
    );
}

#[test]
fn buckets_start_in_order_on_the_last_micro_batch_only() {
    let mut c = comm1();
    // Buckets: [3], [2], [1, 0].
    let mut r = Reducer::new(&[1, 1, 2, 2], 8).unwrap();
    assert_eq!(r.num_buckets(), 3);
    r.begin_step(2).unwrap();
    for p in [3, 2, 1, 0] {
        r.mark_ready(&mut c, p, &vec![1.0; [1, 1, 2, 2][p]])
            .unwrap();
        assert_eq!(r.launched, 0, "no sync before the last micro-batch");
    }
    // Bucket 1 ([2]) completes before bucket 0 ([3]): it waits for bucket 0.
    r.mark_ready(&mut c, 2, &[1.0, 1.0]).unwrap();
    assert_eq!(r.launched, 0);
    r.mark_ready(&mut c, 3, &[1.0, 1.0]).unwrap();
    assert_eq!(r.launched, 2);
    r.mark_ready(&mut c, 1, &[1.0]).unwrap();
    assert_eq!(r.launched, 2);
    r.mark_ready(&mut c, 0, &[1.0]).unwrap();
    assert_eq!(r.launched, 3);
    let g = r.finish(&mut c).unwrap();
    assert!(g.iter().all(|g| g.iter().all(|&x| x == 1.0)));

    // Overlap off: nothing starts before finish.
    r.set_overlap(false);
    r.begin_step(1).unwrap();
    for p in [3, 2, 1, 0] {
        r.mark_ready(&mut c, p, &vec![2.0; [1, 1, 2, 2][p]])
            .unwrap();
    }
    assert_eq!(r.launched, 0);
    let g = r.finish(&mut c).unwrap();
    assert!(g.iter().all(|g| g.iter().all(|&x| x == 2.0)));
    assert!(g.stats().hidden.is_zero());
    assert_eq!(g.stats().overlap_fraction(), 0.0);
}

#[test]
fn misuse_is_reported() {
    let mut c = comm1();
    let mut r = Reducer::new(&[2, 1], 1024).unwrap();
    assert!(matches!(
        r.mark_ready(&mut c, 0, &[1.0, 1.0]),
        Err(Error::State {
            op: "mark_ready",
            ..
        })
    ));
    assert!(matches!(
        r.finish(&mut c),
        Err(Error::State { op: "finish", .. })
    ));
    assert!(r.begin_step(0).is_err());
    r.begin_step(2).unwrap();
    assert!(matches!(
        r.begin_step(2),
        Err(Error::State {
            op: "begin_step",
            ..
        })
    ));
    assert!(matches!(
        r.mark_ready(&mut c, 2, &[1.0]),
        Err(Error::UnknownParam { param: 2, count: 2 })
    ));
    assert!(matches!(
        r.mark_ready(&mut c, 0, &[1.0]),
        Err(Error::GradientLength {
            param: 0,
            expected: 2,
            got: 1
        })
    ));
    r.mark_ready(&mut c, 0, &[1.0, 1.0]).unwrap();
    assert!(matches!(
        r.mark_ready(&mut c, 0, &[1.0, 1.0]),
        Err(Error::AlreadyReady { param: 0, micro: 0 })
    ));
    let e = r.finish(&mut c).unwrap_err().to_string();
    assert!(e.contains("micro-batch 1 of 2") && e.contains("[1]"), "{e}");
    r.mark_ready(&mut c, 1, &[1.0]).unwrap();
    r.mark_ready(&mut c, 1, &[1.0]).unwrap();
    r.mark_ready(&mut c, 0, &[1.0, 1.0]).unwrap();
    assert!(matches!(
        r.mark_ready(&mut c, 0, &[1.0, 1.0]),
        Err(Error::State { .. })
    ));
    assert_eq!(r.finish(&mut c).unwrap().get(1), &[1.0]);
}

#[test]
fn stats_describe_the_span() {
    let s = StepStats {
        buckets: 2,
        bytes: 1000,
        world: 4,
        comm: Duration::from_millis(10),
        wait: Duration::from_millis(3),
        hidden: Duration::from_millis(7),
    };
    assert!((s.overlap_fraction() - 0.7).abs() < 1e-12);
    // 1000 B x 2 x 3/4 in 10 ms.
    assert!((s.bus_bandwidth() - 150_000.0).abs() < 1e-6);
    assert_eq!(StepStats::default().overlap_fraction(), 0.0);
    assert_eq!(StepStats::default().bus_bandwidth(), 0.0);
}
