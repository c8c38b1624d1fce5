//! `gradsync bench` end to end: real ranks over loopback, validated bit for bit.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_gradsync");

fn bench(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RANK")
        .output()
        .expect("run gradsync bench")
}

/// The table rows (lines not starting with `#`).
fn rows(out: &Output) -> Vec<Vec<String>> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[test]
fn every_collective_type_and_op_validates() {
    for coll in [
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "reduce",
        "all_to_all",
    ] {
        let out = bench(
            &[
                coll, "--nproc", "3", "-b", "8", "-e", "8K", "-f", "32", "-n", "2", "-w", "1",
                "-d", "all", "-o", "all", "-r", "1",
            ],
            &[],
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{coll}: {out:?}");
        assert!(
            text.contains("# Out of bounds values : 0 OK"),
            "{coll}:\n{text}"
        );
        let rows = rows(&out);
        let ops = if ["all_gather", "broadcast", "all_to_all"].contains(&coll) {
            1
        } else {
            8
        };
        // The bitwise operators run with the three integer types only.
        let pairs = if ops == 1 { 7 } else { 4 * 5 + 3 * 8 };
        assert_eq!(rows.len(), pairs * 3, "{coll}:\n{text}");
        for row in rows
            .iter()
            .filter(|r| ["band", "bor", "bxor"].contains(&&*r[3]))
        {
            assert!(["int32", "int64", "uint8"].contains(&&*row[2]), "{row:?}");
        }
        for row in &rows {
            assert_eq!(row.len(), 13, "{row:?}");
            let root = if coll == "broadcast" || coll == "reduce" {
                "1"
            } else {
                "-1"
            };
            assert_eq!(row[4], root);
            if ops == 1 {
                assert_eq!(row[3], "none");
            }
            // #wrong is 0 where a variant exists, N/A where the API has none.
            assert!(row[8] == "0" || row[5] == "N/A", "{row:?}");
            assert!(row[12] == "0" || row[9] == "N/A", "{row:?}");
        }
    }
}

#[test]
fn table_shape_and_json() {
    let dir = std::env::temp_dir().join(format!("gradsync-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("rows.json");
    let out = bench(
        &[
            "all_gather",
            "--nproc",
            "2",
            "-b",
            "1K",
            "-e",
            "4K",
            "-i",
            "1K",
            "-n",
            "1",
            "-w",
            "0",
            "-d",
            "int32",
            "--json",
            json.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"));
    assert!(text.contains("# nRanks 2 "), "{text}");
    assert!(text.contains("#  Rank  1 Pid"), "{text}");
    assert!(text.contains("# Avg bus bandwidth    : "));
    let rows = rows(&out);
    let sizes: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(sizes, ["1024", "2048", "3072", "4096"]);
    // all_gather: count is per rank, size is the total.
    assert_eq!(rows[0][1], "128");
    assert_eq!(rows[0][2], "int32");

    let parsed: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let arr = parsed.as_array().unwrap();
    assert_eq!(arr.len(), 4);
    assert_eq!(arr[0]["collective"], "all_gather");
    assert_eq!(arr[0]["world"], 2);
    assert_eq!(arr[0]["dtype"], "int32");
    assert_eq!(arr[0]["op"], "none");
    assert_eq!(arr[0]["out_of_place"]["wrong"], 0);
    assert!(arr[0]["in_place"].is_null());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_single_rank_runs_without_a_launcher_flag() {
    let out = bench(
        &["-b", "64", "-e", "64", "-n", "1", "-w", "0", "-c", "0"],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let rows = rows(&out);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0][8], "N/A");
    assert!(String::from_utf8_lossy(&out.stdout).contains("# nRanks 1 "));
}

/// `--op band|bor|bxor` over 3 ranks with every integer type, at odd element counts (3, 103,
/// 203, 303 int32s), for the reducing collectives: every row validated bit for bit, the float
/// types of `-d all` left out.
#[test]
fn bitwise_ops_validate_on_the_integer_types() {
    for coll in ["all_reduce", "reduce_scatter", "reduce"] {
        for op in ["band", "bor", "bxor"] {
            let out = bench(
                &[
                    coll, "--nproc", "3", "-b", "12", "-e", "1212", "-i", "400", "-n", "2", "-w",
                    "1", "-d", "all", "-o", op, "-r", "2",
                ],
                &[],
            );
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{coll} {op}: {out:?}");
            assert!(text.contains("# Out of bounds values : 0 OK"), "{text}");
            assert!(text.contains(": int32,int64,uint8\n"), "{text}");
            let rows = rows(&out);
            assert_eq!(rows.len(), 3 * 4, "{coll} {op}:\n{text}");
            for row in &rows {
                assert_eq!(row[3], op, "{row:?}");
                assert!(["int32", "int64", "uint8"].contains(&&*row[2]), "{row:?}");
                assert_eq!(row[8], "0", "{coll} {op}: {row:?}");
                assert!(row[12] == "0" || row[9] == "N/A", "{row:?}");
            }
            let counts: Vec<&str> = rows.iter().take(4).map(|r| r[1].as_str()).collect();
            let want = if coll == "reduce_scatter" {
                // The count is per rank: 12..1212 bytes over 3 ranks of int32.
                ["1", "34", "67", "101"]
            } else {
                ["3", "103", "203", "303"]
            };
            assert_eq!(counts, want, "{coll} {op}");
        }
    }
}

/// A bitwise operator with a float type and nothing else is refused before any rank starts,
/// with the operator and the type named.
#[test]
fn bitwise_op_on_a_float_type_is_refused() {
    for (dtype, name) in [
        ("float", "float"),
        ("bf16", "bfloat16"),
        ("double", "double"),
    ] {
        let out = bench(&["--nproc", "2", "-d", dtype, "-o", "bxor"], &[]);
        assert!(!out.status.success(), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!(
                "--op bxor is a bitwise operator, defined for the integer data types only \
                 (int32, int64, uint8), not for --datatype {name}"
            )),
            "{err}"
        );
        assert!(rows(&out).is_empty(), "{out:?}");
    }
}

#[test]
fn root_out_of_range_is_refused() {
    let out = bench(&["reduce", "--nproc", "2", "-r", "2"], &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--root 2"));
}

#[test]
fn logging_variables_reach_the_ranks() {
    let out = bench(
        &["--nproc", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0"],
        &[("GRADSYNC_DEBUG", "VERSION")],
    );
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    let version_lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains(" GRADSYNC INFO gradsync version "))
        .collect();
    assert_eq!(version_lines.len(), 2, "{err}");
    // host:pid:tid [rank] GRADSYNC INFO ...
    let head = version_lines[0].split(' ').next().unwrap();
    assert_eq!(head.split(':').count(), 3, "{head}");

    let dir = std::env::temp_dir().join(format!("gradsync-log-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("log.%h.%p");
    let out = bench(
        &["--nproc", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0"],
        &[
            ("GRADSYNC_DEBUG", "INFO"),
            ("GRADSYNC_DEBUG_FILE", template.to_str().unwrap()),
            ("GRADSYNC_DEBUG_SUBSYS", "^COLL,BOGUS"),
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    for f in &files {
        let name = f.file_name().unwrap().to_str().unwrap();
        let pid = name.rsplit('.').next().unwrap();
        let text = std::fs::read_to_string(f).unwrap();
        assert!(
            text.lines().all(|l| l.contains(&format!(":{pid}:"))),
            "{text}"
        );
        assert!(text.contains("GRADSYNC INFO gradsync version"), "{text}");
    }
    // A bad value is reported on stderr, not only in the file.
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown subsystem \"BOGUS\""));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh directory holding `pinned.json`, a cost model of 2 us and 1 GB/s per link.
fn pinned_model(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("gradsync-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pinned = dir.join("pinned.json");
    std::fs::write(
        &pinned,
        r#"{"transport": "shm", "alpha_us": 2.0, "gbytes_per_s": 1.0}"#,
    )
    .unwrap();
    (dir, pinned)
}

/// `gradsync bench ARGS` under the cost model pinned in `model`, with the `COLL` subsystem
/// logging at INFO; returns the output and its stderr as text.
fn bench_logging_choices(args: &[&str], model: &std::path::Path) -> (Output, String) {
    let out = bench(
        args,
        &[
            ("GRADSYNC_COST_FILE", model.to_str().unwrap()),
            ("GRADSYNC_DEBUG", "INFO"),
            ("GRADSYNC_DEBUG_SUBSYS", "COLL"),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (out, err)
}

/// The lines of the `--explain` section for `size` (the line after `# ` starts with it).
fn explain_row(out: &Output, size: &str) -> Vec<String> {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let after = text.split("# explain:").nth(1).expect("an explain section");
    after
        .lines()
        .map(|l| {
            l.trim_start_matches('#')
                .split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .find(|w| w.first().map(String::as_str) == Some(size))
        .unwrap_or_else(|| panic!("no explain row for {size}: {after}"))
}

#[test]
fn explain_prints_every_algorithm_under_a_pinned_or_measured_model() {
    let (dir, pinned) = pinned_model("explain");
    let args = [
        "all_reduce",
        "--nproc",
        "2",
        "-b",
        "8",
        "-e",
        "64K",
        "-f",
        "8",
        "-n",
        "2",
        "-w",
        "1",
        "--explain",
    ];
    let out = bench(&args, &[("GRADSYNC_COST_FILE", pinned.to_str().unwrap())]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("pinned in") && text.contains("alpha 2.00 us, 1.000 GB/s"),
        "{text}"
    );
    // The table keeps its nccl-tests shape: the explain lines are comments.
    assert_eq!(rows(&out).len(), 5, "{text}");
    // 8 bytes on 2 ranks: eager is one message (2 us + 8 ns); the ring, recursive doubling and
    // halving-doubling exchange one message per step, the tree two one after the other, the
    // double tree one each way in each of its two trees, at once.
    let r = explain_row(&out, "8");
    assert_eq!(
        &r[1..7],
        ["2.0", "4.0", "2.0", "4.0", "4.0", "4.0"],
        "eager ring rd rabenseifner tree double_tree: {r:?}"
    );
    assert_eq!(r[r.len() - 2], "eager", "the automatic choice: {r:?}");
    // 32 KiB: the bandwidth term (32.8 us at 1 GB/s) shows up. On 2 ranks recursive doubling
    // sends it in one message, the ring in two halves (one more latency), the tree twice; the
    // double tree pipelines 8 KiB segments (two per hop), four messages of 8.2 us per rank and
    // two more latencies.
    let r = explain_row(&out, "32768");
    assert_eq!(r[1], "-", "not eager at 32 KiB: {r:?}");
    assert_eq!(&r[2..7], ["36.8", "34.8", "36.8", "69.5", "40.8"], "{r:?}");
    assert_eq!(
        r[r.len() - 3],
        "recursive_doubling",
        "the model's best: {r:?}"
    );
    // With a path that does not exist yet, init measures the model and saves it there.
    let saved = dir.join("saved.json");
    let out = bench(&args, &[("GRADSYNC_COST_FILE", saved.to_str().unwrap())]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("(measured at init in") && text.contains("saved to"),
        "{text}"
    );
    let model: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    for link in ["intra", "inter"] {
        assert!(model[link]["alpha_us"].as_f64().unwrap() > 0.0, "{model}");
        assert!(
            model[link]["gbytes_per_s"].as_f64().unwrap() > 0.0,
            "{model}"
        );
    }
    // The next run reads it (pinned): nothing is measured.
    let out = bench(&args, &[("GRADSYNC_COST_FILE", saved.to_str().unwrap())]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("(pinned in"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn info_log_explains_every_all_reduce_choice_once_per_size_class() {
    let (dir, pinned) = pinned_model("info");
    let args = [
        "all_reduce",
        "--nproc",
        "2",
        "-b",
        "8",
        "-e",
        "32K",
        "-f",
        "64",
        "-n",
        "3",
        "-w",
        "1",
    ];
    let (_, err) = bench_logging_choices(&args, &pinned);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains(" bytes (pinned in"))
        .collect();
    // Sizes 8, 512 and 32768: one line each, from rank 0 only, however many calls.
    assert_eq!(lines.len(), 3, "{err}");
    assert!(
        lines[0].contains("all_reduce of 8 bytes on 2 ranks")
            && lines[0].contains("eager 2.0 us ring 4.0 us recursive_doubling 2.0 us")
            && lines[0].ends_with("model's choice recursive_doubling, runs eager"),
        "{}",
        lines[0]
    );
    assert!(
        lines[2].contains(
            "ring 36.8 us recursive_doubling 34.8 us rabenseifner 36.8 us tree 69.5 us double_tree 40.8 us"
        ) && lines[2].ends_with("model's choice recursive_doubling, runs recursive_doubling"),
        "{}",
        lines[2]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The automatic all-reduce choice follows the cost model: on a model where latency dominates,
/// a 256 KiB all-reduce on 4 ranks runs recursive doubling (2 steps of one 512 KiB segment,
/// where halving-doubling takes 4), where bandwidth dominates it runs one of the
/// bandwidth-optimal schedules. (At 1 MiB recursive doubling's steps are two segments each, as
/// many messages as halving-doubling's four, which then wins by its smaller ones.)
#[test]
fn automatic_choice_follows_the_cost_model() {
    let dir = std::env::temp_dir().join(format!("gradsync-choice-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut runs = Vec::new();
    for (name, alpha, gbps) in [("latency", 1000.0, 100.0), ("bandwidth", 0.01, 0.1)] {
        let f = dir.join(format!("{name}.json"));
        std::fs::write(
            &f,
            format!(r#"{{"transport": "shm", "alpha_us": {alpha}, "gbytes_per_s": {gbps}}}"#),
        )
        .unwrap();
        let args = [
            "all_reduce",
            "--nproc",
            "4",
            "-b",
            "256K",
            "-e",
            "256K",
            "-n",
            "1",
            "-w",
            "0",
        ];
        let (_, err) = bench_logging_choices(&args, &f);
        let line = err
            .lines()
            .find(|l| l.contains("all_reduce of 262144 bytes on 4 ranks"))
            .unwrap_or_else(|| panic!("no choice logged: {err}"));
        let tail = line.rsplit("model's choice ").next().unwrap();
        let (choice, ran) = tail.split_once(", runs ").expect("choice and run");
        assert_eq!(choice, ran, "{line}");
        runs.push(ran.to_string());
    }
    assert_eq!(runs[0], "recursive_doubling", "{runs:?}");
    assert!(
        ["ring", "rabenseifner"].contains(&runs[1].as_str()),
        "{runs:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--compare ... --tune` records each size's medians and fastest forced algorithm in the cost
/// file; later runs on the same world take that algorithm for the size class, where the model
/// would have chosen another, and say so at INFO.
#[test]
fn tune_records_the_fastest_and_the_automatic_choice_takes_it() {
    let (dir, pinned) = pinned_model("tune");
    let env = [("GRADSYNC_COST_FILE", pinned.to_str().unwrap())];
    // Two algorithms the model ranks below the ring on this model: whichever is faster, the
    // measured choice differs from the model's.
    let sizes = [
        "all_reduce",
        "--nproc",
        "3",
        "-b",
        "64K",
        "-e",
        "1M",
        "-f",
        "16",
        "--settle",
        "0",
    ];
    let tune = ["-n", "2", "-w", "1", "--rounds", "3"];
    let tune = [&tune[..], &["--compare", "auto,tree,double_tree", "--tune"]].concat();
    let out = bench(&[&sizes[..], &tune].concat(), &env);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!(
            "# tune: recorded the fastest algorithm of 2 sizes on 3 ranks in {}",
            pinned.display()
        )),
        "{text}"
    );
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&pinned).unwrap()).unwrap();
    let measured = file["measured"].as_array().expect("measured entries");
    assert_eq!(measured.len(), 2, "{file}");
    let rows = rows(&out);
    for (m, row) in measured.iter().zip(&rows) {
        assert_eq!(m["world"], 3, "{m}");
        assert_eq!(m["bytes"].to_string(), row[0], "{m}");
        // The recorded fastest is the table's best forced algorithm, with its medians.
        assert_eq!(m["algorithm"].as_str().unwrap(), row[4], "{m}");
        let tree: f64 = row[2].parse().unwrap();
        assert!(
            (m["us"]["tree"][0].as_f64().unwrap() - tree).abs() <= 0.051,
            "{m} {row:?}"
        );
    }
    // The next run's automatic choice takes the measured fastest and logs both choices.
    let (_, err) = bench_logging_choices(&[&sizes[..], &["-n", "1", "-w", "0"]].concat(), &pinned);
    for m in measured {
        let bytes = m["bytes"].to_string();
        let line = err
            .lines()
            .find(|l| l.contains(&format!("all_reduce of {bytes} bytes on 3 ranks")))
            .unwrap_or_else(|| panic!("no choice logged for {bytes}: {err}"));
        let algo = m["algorithm"].as_str().unwrap();
        assert!(
            line.contains(&format!("measured at {bytes} bytes (median of 1 run):"))
                && line.ends_with(&format!(", measured choice {algo}, runs {algo}")),
            "{line}"
        );
        assert!(!line.contains(&format!("model's choice {algo}")), "{line}");
    }
    // A world that was not measured keeps the model's choice.
    let (_, err) = bench_logging_choices(
        &[
            "all_reduce",
            "--nproc",
            "2",
            "-b",
            "64K",
            "-e",
            "64K",
            "-n",
            "1",
            "-w",
            "0",
        ],
        &pinned,
    );
    assert!(!err.contains("measured choice"), "{err}");
    // Tuning needs a forced algorithm to measure.
    let bad = bench(
        &["all_reduce", "--nproc", "2", "--compare", "auto", "--tune"],
        &env,
    );
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--tune needs at least one forced algorithm"),
        "{bad:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One all-reduce of 8 bytes on `nproc` ranks with `--explain`, its cache in `dir`: the
/// stdout of a run that must succeed.
fn explain_once(nproc: &str, dir: &std::path::Path, env: &[(&str, &str)]) -> String {
    let mut vars = vec![("XDG_CACHE_HOME", dir.to_str().unwrap())];
    vars.extend_from_slice(env);
    let out = bench(
        &[
            "all_reduce",
            "--nproc",
            nproc,
            "-b",
            "8",
            "-e",
            "8",
            "-n",
            "1",
            "-w",
            "0",
            "--explain",
        ],
        &vars,
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    text
}

/// Runs `f` while a thread per CPU of this machine spins: the host is busy throughout.
fn with_every_cpu_busy<T>(f: impl FnOnce() -> T) -> T {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let spinners: Vec<_> = (0..std::thread::available_parallelism().map_or(2, |n| n.get()))
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let out = f();
    stop.store(true, Ordering::Relaxed);
    spinners.into_iter().for_each(|t| t.join().unwrap());
    out
}

/// Init measures the links once per host and caches the model, with how busy the host was; the
/// next init reads the cache (a model of a busy host only while the host is still busy),
/// `GRADSYNC_CALIBRATE=always` measures again and `off` never measures.
#[test]
fn init_calibrates_once_and_caches_per_host() {
    let dir = std::env::temp_dir().join(format!("gradsync-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let run = |calibrate: &str| explain_once("2", &dir, &[("GRADSYNC_CALIBRATE", calibrate)]);
    let first = run("auto");
    assert!(first.contains("(measured at init in"), "{first}");
    let files: Vec<_> = std::fs::read_dir(dir.join("gradsync"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("cost-") && name.ends_with("-shm-shm.json"),
        "{name}"
    );
    // How busy the host was just before the links were measured; set as if it was quiet.
    let set_others = |o: f64| {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
        let others = v["intra"]["others"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&others), "{v}");
        for link in ["intra", "inter"] {
            v[link]["others"] = serde_json::json!(o);
        }
        std::fs::write(&files[0], serde_json::to_string(&v).unwrap()).unwrap();
    };
    set_others(0.0);
    let second = run("auto");
    assert!(
        second.contains(&format!("(cached in {}", files[0].display())),
        "{second}"
    );
    // Links measured on a busy host are measured again only on a quiet one.
    set_others(0.9);
    let busy = with_every_cpu_busy(|| run("auto"));
    assert!(
        busy.contains(&format!("(cached in {}", files[0].display())),
        "{busy}"
    );
    assert!(run("always").contains("(measured at init in"));
    assert!(run("off").contains("(cached in"));
    std::fs::remove_dir_all(dir.join("gradsync")).unwrap();
    assert!(run("off").contains("(uncalibrated)"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// On one host of 3 ranks the first init also times every candidate at 8 KiB to 32 MiB and
/// keeps the times in the cache for its layout, with how busy other processes kept the host;
/// later inits of that layout reuse them (times of a busy host only while the host is still
/// busy), and a forced algorithm skips the timing, as does a setting that would take it over
/// its budget.
#[test]
fn init_times_the_candidates_once_per_layout() {
    let dir = std::env::temp_dir().join(format!("gradsync-bulk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let run = |nproc: &str, env: &[(&str, &str)]| explain_once(nproc, &dir, env);
    let cache = || {
        let files: Vec<_> = std::fs::read_dir(dir.join("gradsync"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
        v
    };
    // Forced: the links are measured, the candidates are not timed.
    let forced = run("3", &[("GRADSYNC_ALGO", "ring")]);
    assert!(forced.contains("(measured at init in"), "{forced}");
    assert!(!forced.contains("candidates timed"), "{forced}");
    assert!(cache().get("bulk").is_none());
    // The model is cached: only the candidates are timed, once, at all seven sizes within a
    // budget that a busy machine cannot exceed.
    let first = run("3", &[("GRADSYNC_CALIBRATE_BUDGET", "120")]);
    assert!(
        first.contains("candidates timed at 8 KiB to 32 MiB in"),
        "{first}"
    );
    assert!(
        first.contains("# candidates timed at init (us per call)"),
        "{first}"
    );
    assert!(first.contains("#        32768 double_tree "), "{first}");
    let bulk = cache()["bulk"].clone();
    let entries = bulk.as_array().unwrap();
    let sizes: Vec<_> = entries.iter().map(|e| e["bytes"].as_u64()).collect();
    assert_eq!(
        sizes,
        [
            8 << 10,
            32 << 10,
            128 << 10,
            512 << 10,
            2 << 20,
            8 << 20,
            32 << 20
        ]
        .map(Some)
    );
    for entry in entries {
        assert_eq!(entry["world"].as_u64(), Some(3));
        let us = entry["us"].as_object().unwrap();
        let names: Vec<_> = us.keys().map(String::as_str).collect();
        // Recursive doubling is timed up to 512 KiB.
        if entry["bytes"].as_u64().unwrap() <= 512 << 10 {
            assert_eq!(
                names,
                [
                    "double_tree",
                    "rabenseifner",
                    "recursive_doubling",
                    "ring",
                    "tree"
                ]
            );
        } else {
            assert_eq!(names, ["double_tree", "rabenseifner", "ring", "tree"]);
        }
        assert!(us.values().all(|t| t.as_f64().unwrap() > 0.0), "{us:?}");
        // How much of the CPUs other processes took meanwhile (the test suite, here).
        let others = entry["others"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&others), "{entry}");
    }
    let cache_file = || {
        std::fs::read_dir(dir.join("gradsync"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path()
    };
    // Sets how busy the host was when the candidates were timed, as the cache says, and
    // makes each entry the median of three timings.
    let set_others = |o: f64| {
        let path = cache_file();
        let mut v = cache();
        for e in v["bulk"].as_array_mut().unwrap() {
            e["others"] = serde_json::json!(o);
            let runs: serde_json::Map<_, _> = e["us"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, t)| (k.clone(), serde_json::json!([t, t, t])))
                .collect();
            e["runs"] = serde_json::Value::Object(runs);
        }
        std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
        v["bulk"].clone()
    };
    // A first quiet timing is one run of three.
    assert!(
        first.contains("the median of 1 of 3 quiet timings") || !first.contains("quiet timings"),
        "{first}"
    );
    // Times settled on a quiet host are reused.
    let bulk = set_others(0.0);
    let second = run("3", &[]);
    assert!(second.contains("(cached in"), "{second}");
    assert!(!second.contains("candidates timed at 8 KiB"), "{second}");
    assert!(second.contains("# candidates timed at init"), "{second}");
    assert_eq!(cache()["bulk"], bulk);
    // Times taken on a busy host are timed again only on a quiet one: with every CPU kept
    // busy, the init reuses them rather than time the load again.
    let bulk = set_others(0.9);
    let busy = with_every_cpu_busy(|| run("3", &[]));
    assert!(busy.contains("(cached in"), "{busy}");
    assert!(!busy.contains("candidates timed at 8 KiB"), "{busy}");
    assert_eq!(cache()["bulk"], bulk);
    // Quiet times from a file without the smallest size (written before it was timed): not
    // timed again on a busy host either, where the timing would be dropped beside them.
    set_others(0.0);
    let mut v = cache();
    v["bulk"]
        .as_array_mut()
        .unwrap()
        .retain(|e| e["bytes"].as_u64() != Some(8 << 10));
    std::fs::write(cache_file(), serde_json::to_string(&v).unwrap()).unwrap();
    let older = with_every_cpu_busy(|| run("3", &[]));
    assert!(older.contains("(cached in"), "{older}");
    assert!(!older.contains("candidates timed at 8 KiB"), "{older}");
    assert_eq!(cache()["bulk"], v["bulk"]);
    // Two ranks are never timed.
    let two = run("2", &[]);
    assert!(!two.contains("candidates timed"), "{two}");
    // 4 ranks with 8-byte chunks: the probe finds the timing far over its budget, so the
    // init times nothing at 8 MiB and keeps no times for that layout.
    let slow = run("4", &[("GRADSYNC_CHUNK_SIZE", "8")]);
    assert!(
        slow.contains("candidates not timed: a ring all-reduce of 512 KiB took"),
        "{slow}"
    );
    assert!(slow.contains("over 10 times the budget of 3.0 s"), "{slow}");
    let layouts: Vec<_> = cache()["bulk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["world"].as_u64())
        .collect();
    // (The 3-rank layout without its 8 KiB entry, as left above.)
    assert_eq!(layouts, [Some(3); 6]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--compare` times the algorithms in turns inside one run and prints one line per size with
/// every algorithm, the fastest forced one and auto against it.
#[test]
fn compare_prints_algorithms_side_by_side() {
    let out = bench(
        &[
            "all_reduce",
            "--nproc",
            "3",
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "64",
            "-n",
            "2",
            "-w",
            "1",
            "--rounds",
            "3",
            "--compare",
            "auto,ring,tree",
        ],
        &[],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let lines: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (l, size) in lines.iter().zip(["8", "512", "32768"]) {
        assert_eq!(l[0], size, "{text}");
        let t: Vec<f64> = l[1..4].iter().map(|x| x.parse().unwrap()).collect();
        assert!(t.iter().all(|&x| x > 0.0), "{l:?}");
        let best = if t[1] <= t[2] { "ring" } else { "tree" };
        assert_eq!(l[4], best, "{l:?}");
        let ratio: f64 = l[5].parse().unwrap();
        assert!((ratio - t[0] / t[1].min(t[2])).abs() < 0.01, "{l:?}");
    }
    assert!(text.contains("(auto runs eager)"), "{text}");
    let bad = bench(&["reduce", "--nproc", "2", "--compare", "ring"], &[]);
    assert!(!bad.status.success());
}
