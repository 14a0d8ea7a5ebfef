//! The training job's reporting: metrics files, the plot and the progress lines.

use std::path::{Path, PathBuf};

use mixprec::train::metrics::{read_jsonl, EpochRecord, MetricsWriter, CSV_HEADER};
use mixprec::train::plot::{plot_history, HEIGHT, WIDTH};
use mixprec::train::progress::{group_thousands, progress_line, EpochProgress, ProgressMode};
use mixprec::Error;

/// A fresh directory under the target's temp dir, named after the test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("train_report_{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn record(epoch: usize) -> EpochRecord {
    let e = epoch as f64;
    EpochRecord {
        epoch,
        step: 78 * epoch as u64,
        train_loss: 1.2 / e,
        train_accuracy: if epoch.is_multiple_of(2) {
            Some(0.6 + 0.03 * e)
        } else {
            None
        },
        test_loss: 1.0 / e + 0.1,
        test_accuracy: 0.7 + 0.02 * e,
        lr: 0.1 * 0.9f64.powi(epoch as i32),
        images_per_s: 5120.5,
        epoch_seconds: 1.75,
        loss_scale: 65536.0,
        skipped_steps: epoch as u64 % 3,
    }
}

fn history(n: usize) -> Vec<EpochRecord> {
    (1..=n).map(record).collect()
}

#[test]
fn csv_has_the_header_and_one_row_per_epoch() {
    let dir = temp_dir("csv");
    let mut w = MetricsWriter::create(&dir).unwrap();
    assert_eq!(w.csv_path(), dir.join("metrics.csv"));
    assert_eq!(w.jsonl_path(), dir.join("metrics.jsonl"));
    let text = std::fs::read_to_string(w.csv_path()).unwrap();
    assert_eq!(text, format!("{CSV_HEADER}\n"));

    for r in history(2) {
        w.append(&r).unwrap();
    }
    let text = std::fs::read_to_string(w.csv_path()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(
        lines[0],
        "epoch,step,train_loss,train_accuracy,test_loss,test_accuracy,lr,images_per_s,\
         epoch_seconds,loss_scale,skipped_steps"
    );
    let columns = lines[0].split(',').count();
    for line in &lines[1..] {
        assert_eq!(line.split(',').count(), columns, "{line}");
    }
    // Epoch 1 has no train accuracy: an empty field.
    assert_eq!(
        lines[1],
        "1,78,1.2,,1.1,0.72,0.09000000000000001,5120.5,1.75,65536,1"
    );
    assert!(
        lines[2].starts_with("2,156,0.6,0.6599999999999999,0.6,0.74,0.081"),
        "{}",
        lines[2]
    );
    assert_eq!(w.history(), &history(2)[..]);
}

#[test]
fn jsonl_round_trips_through_read_jsonl() {
    let dir = temp_dir("jsonl");
    let mut w = MetricsWriter::create(&dir).unwrap();
    let mut rs = history(4);
    rs[2].train_loss = f64::NAN;
    rs[2].test_loss = f64::INFINITY;
    rs[3].train_accuracy = Some(f64::NEG_INFINITY);
    // Values whose shortest decimal form is long or subnormal read back bit for bit.
    rs[0].lr = 5e-324;
    rs[1].lr = 1.0 / 3.0;
    rs[1].train_loss = 0.39999999999999997;
    for r in &rs {
        w.append(r).unwrap();
    }
    let back = read_jsonl(w.jsonl_path()).unwrap();
    assert_eq!(back.len(), 4);
    // NaN != NaN: compare the NaN field apart, the rest with ==.
    assert!(back[2].train_loss.is_nan());
    let mut fixed = back.clone();
    fixed[2].train_loss = 0.0;
    rs[2].train_loss = 0.0;
    assert_eq!(fixed, rs);
    assert_eq!(back[2].test_loss, f64::INFINITY);
    assert_eq!(back[3].train_accuracy, Some(f64::NEG_INFINITY));
    assert_eq!(back[0].train_accuracy, None);

    let text = std::fs::read_to_string(w.jsonl_path()).unwrap();
    assert_eq!(text.lines().count(), 4);
    assert!(text.contains("\"train_loss\":\"NaN\""), "{text}");
    assert!(text.contains("\"train_accuracy\":null"), "{text}");
}

#[test]
fn resume_rewrites_the_files_with_the_history_then_appends() {
    let dir = temp_dir("resume");
    let mut w = MetricsWriter::create(&dir).unwrap();
    for r in history(5) {
        w.append(&r).unwrap();
    }
    drop(w);
    // Resumed from the checkpoint of epoch 3: epochs 4 and 5 are gone, then a new 4 is logged.
    let all = read_jsonl(&dir.join("metrics.jsonl")).unwrap();
    let mut w = MetricsWriter::resume(&dir, &all[..3]).unwrap();
    assert_eq!(w.history(), &history(3)[..]);
    let mut r4 = record(4);
    r4.test_accuracy = 0.9;
    w.append(&r4).unwrap();

    let mut want = history(3);
    want.push(r4);
    assert_eq!(w.history(), &want[..]);
    assert_eq!(read_jsonl(w.jsonl_path()).unwrap(), want);
    let csv = std::fs::read_to_string(w.csv_path()).unwrap();
    assert_eq!(csv.lines().count(), 5, "{csv}");
    assert_eq!(csv.lines().next(), Some(CSV_HEADER));
    assert!(csv.lines().last().unwrap().contains(",0.9,"), "{csv}");
    // No temporary files are left behind.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn create_makes_missing_directories_and_truncates() {
    let dir = temp_dir("create").join("run").join("a");
    let mut w = MetricsWriter::create(&dir).unwrap();
    w.append(&record(1)).unwrap();
    drop(w);
    let w = MetricsWriter::create(&dir).unwrap();
    assert!(w.history().is_empty());
    assert!(read_jsonl(w.jsonl_path()).unwrap().is_empty());
    assert_eq!(
        std::fs::read_to_string(w.csv_path())
            .unwrap()
            .lines()
            .count(),
        1
    );
}

#[test]
fn a_corrupt_jsonl_line_is_an_error_naming_the_file_and_line() {
    let dir = temp_dir("corrupt");
    let mut w = MetricsWriter::create(&dir).unwrap();
    for r in history(2) {
        w.append(&r).unwrap();
    }
    let path = w.jsonl_path().to_path_buf();
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push('\n'); // a blank line is skipped, but counted
    text.push_str("{\"epoch\": 3, \"step\": 2\n");
    std::fs::write(&path, text).unwrap();

    let err = read_jsonl(&path).unwrap_err();
    match &err {
        Error::DataFormat {
            path: p, detail, ..
        } => {
            assert_eq!(p, &path.display().to_string());
            assert!(detail.starts_with("line 4:"), "{detail}");
        }
        other => panic!("expected DataFormat, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("metrics.jsonl") && msg.contains("line 4"),
        "{msg}"
    );

    // A string that is not a non-finite number is rejected too.
    let bad = record(1).json_line().replace("1.2", "\"fast\"");
    std::fs::write(&path, bad).unwrap();
    let msg = read_jsonl(&path).unwrap_err().to_string();
    assert!(msg.contains("line 1") && msg.contains("fast"), "{msg}");
}

#[test]
fn io_failures_are_errors_naming_the_path() {
    let dir = temp_dir("io");
    let missing = dir.join("nope.jsonl");
    let msg = read_jsonl(&missing).unwrap_err().to_string();
    assert!(msg.contains("nope.jsonl"), "{msg}");

    // A file where the directory should be.
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("file");
    std::fs::write(&file, "x").unwrap();
    let msg = MetricsWriter::create(&file.join("run"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("file"), "{msg}");
    let msg = plot_history(&history(3), &file.join("plot.png"), "t")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("plot.png"), "{msg}");
}

/// Decodes a PNG and returns (width, height, RGB bytes).
fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

/// How many pixels are close to `rgb`.
fn count_color(px: &[u8], rgb: [u8; 3]) -> usize {
    px.chunks(3)
        .filter(|p| p.iter().zip(rgb).all(|(&a, b)| a.abs_diff(b) < 24))
        .count()
}

const TRAIN_BLUE: [u8; 3] = [31, 119, 180];
const TEST_ORANGE: [u8; 3] = [255, 127, 14];

#[test]
fn plot_writes_a_png_of_the_expected_size_with_both_series() {
    let dir = temp_dir("plot");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("plot.png");
    plot_history(&history(10), &path, "resnet18 O2 fashion-mnist").unwrap();
    let (w, h, px) = decode(&path);
    assert_eq!((w as usize, h as usize), (WIDTH, HEIGHT));
    assert_eq!(px.len(), WIDTH * HEIGHT * 3);
    let white = count_color(&px, [255, 255, 255]);
    assert!(white < WIDTH * HEIGHT, "blank image");
    assert!(white > WIDTH * HEIGHT / 2, "mostly background: {white}");
    assert!(count_color(&px, TRAIN_BLUE) > 200, "no train line");
    assert!(count_color(&px, TEST_ORANGE) > 200, "no test line");
    // Dark pixels: text, ticks, frames.
    assert!(count_color(&px, [40, 40, 40]) > 1000);

    // Replaced in place, with no temporary left beside it.
    plot_history(&history(3), &path, "again").unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
}

#[test]
fn plot_handles_one_epoch_flat_lines_nan_and_many_epochs() {
    let dir = temp_dir("plot_edges");
    std::fs::create_dir_all(&dir).unwrap();
    let check = |name: &str, hist: &[EpochRecord]| {
        let path = dir.join(name);
        plot_history(hist, &path, name).unwrap();
        let (w, h, px) = decode(&path);
        assert_eq!((w as usize, h as usize), (WIDTH, HEIGHT), "{name}");
        px
    };

    let one = check("one.png", &history(1));
    assert!(
        count_color(&one, TEST_ORANGE) > 20,
        "one epoch shows a marker"
    );

    let flat: Vec<EpochRecord> = history(6)
        .into_iter()
        .map(|mut r| {
            r.train_loss = 0.5;
            r.test_loss = 0.5;
            r.test_accuracy = 1.0;
            r
        })
        .collect();
    check("flat.png", &flat);

    let mut nan = history(8);
    nan[3].train_loss = f64::NAN;
    nan[4].test_loss = f64::INFINITY;
    nan[5].test_accuracy = f64::NAN;
    check("nan.png", &nan);

    let all_nan: Vec<EpochRecord> = history(4)
        .into_iter()
        .map(|mut r| {
            r.train_loss = f64::NAN;
            r.test_loss = f64::NAN;
            r
        })
        .collect();
    check("all_nan.png", &all_nan);

    let many = check("many.png", &history(250));
    assert!(count_color(&many, TRAIN_BLUE) > 200);

    check("empty.png", &[]);

    let mut huge = history(6);
    huge[1].train_loss = 1e308;
    huge[2].train_loss = -1e299;
    huge[3].test_loss = 1e299;
    huge[4].test_loss = 5e-324;
    huge[5].test_accuracy = 1e10;
    check("huge.png", &huge);

    let tiny: Vec<EpochRecord> = history(5)
        .into_iter()
        .map(|mut r| {
            r.train_loss *= 1e-7;
            r.test_loss *= 1e-7;
            r
        })
        .collect();
    check("tiny.png", &tiny);
    check("long_title.png", &history(3)[..]);
    let long = "x".repeat(500) + "\u{00e9}\u{4e2d}";
    plot_history(&history(3), &dir.join("t.png"), &long).unwrap();
}

#[test]
fn progress_lines_are_plain_and_complete() {
    assert_eq!(
        progress_line(3, 10, 31, 78, 5120.4, ""),
        "epoch 3/10: 39% (31/78 steps), 5,120 images/s"
    );
    assert_eq!(
        progress_line(3, 10, 39, 78, 5120.6, "loss 0.4123"),
        "epoch 3/10: 50% (39/78 steps), 5,121 images/s, loss 0.4123"
    );
    assert_eq!(
        progress_line(1, 1, 0, 10, f64::INFINITY, ""),
        "epoch 1/1: 0% (0/10 steps)"
    );
    assert_eq!(
        progress_line(2, 5, 7, 0, 12.0, "loss 1.5"),
        "epoch 2/5: 7 steps, 12 images/s, loss 1.5"
    );
    assert_eq!(
        progress_line(1, 2, 12, 10, 1.0, ""),
        "epoch 1/2: 100% (12/10 steps), 1 images/s"
    );
    assert!(!progress_line(1, 2, 3, 10, 1e9, "m").contains('\x1b'));

    assert_eq!(group_thousands(0), "0");
    assert_eq!(group_thousands(999), "999");
    assert_eq!(group_thousands(1000), "1,000");
    assert_eq!(group_thousands(5120), "5,120");
    assert_eq!(group_thousands(1234567), "1,234,567");
}

#[test]
fn progress_runs_in_every_mode_without_a_terminal() {
    for mode in [ProgressMode::Off, ProgressMode::Lines, ProgressMode::Bar] {
        let mut p = EpochProgress::new(1, 2, 20, mode);
        for i in 0..25 {
            p.tick(64);
            if i == 5 {
                p.set_message("loss 0.5");
            }
        }
        p.println("a log line");
        p.finish();
        let mut p = EpochProgress::new(2, 2, 0, mode);
        p.tick(1);
        p.finish();
    }
    // Tests do not run on a terminal's stderr (cargo captures it).
    let _ = ProgressMode::detect();
}
