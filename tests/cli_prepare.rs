//! End-to-end: `hslake prepare` on a tiny word-level model — loss masks, every kind of bad record
//! named by line and left out, `--strict`, `--max-seq-len`, Parquet in and out, outputs that
//! `hslake capture` reads, bad arguments refused at once, and records or templates over their
//! bounds left out by name.
mod common;

use common::hslake;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const TEMPLATE: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
const WORDS: &[&str] = &[
    "[UNK]",
    "<|im_start|>",
    "<|im_end|>",
    "system",
    "user",
    "assistant",
    "hi",
    "hello",
    "there",
    "be",
    "brief",
    "q",
    "a",
    "long",
    ".",
];

/// A model directory with a word-level tokenizer (whitespace split), ChatML template, eos `<|im_end|>`.
pub fn tiny_model(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> = WORDS
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i.into()))
        .collect();
    let added: Vec<serde_json::Value> = [0, 1, 2]
        .iter()
        .map(|&i| serde_json::json!({"id": i, "content": WORDS[i], "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(model.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(
        model.join("tokenizer_config.json"),
        r#"{"eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    std::fs::write(model.join("chat_template.jinja"), TEMPLATE).unwrap();
    model
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn prepare(model: &Path, input: &Path, output: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "prepare",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    hslake(&args)
}

fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn ints(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

const GOOD: &str = r#"{"id": 10, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}"#;

#[test]
fn masks_the_assistant_tokens_and_its_end_of_turn_token() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, format!("{GOOD}\n")).unwrap();
    let out = dir.path().join("out.jsonl");
    let o = prepare(&model, &input, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = read_jsonl(&out);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["id"], 10);
    // <|im_start|> user hi <|im_end|> <|im_start|> assistant hello there <|im_end|>
    assert_eq!(ints(&rows[0]["input_ids"]), [1, 4, 6, 2, 1, 5, 7, 8, 2]);
    assert_eq!(ints(&rows[0]["loss_mask"]), [0, 0, 0, 0, 0, 0, 1, 1, 1]);

    let all = dir.path().join("all.jsonl");
    let o = prepare(&model, &input, &all, &["--loss-on", "all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(ints(&read_jsonl(&all)[0]["loss_mask"]), [1; 9]);
}

#[test]
fn names_each_bad_line_and_writes_exactly_the_good_rows() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    let mut bytes = Vec::new();
    for line in [
        GOOD,                                                                                     // 1
        r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}"#, // 2: id 1 (record index)
        r#"{"messages": []}"#,                                       // 3
        r#"{"messages": [{"role": "user", "content": "hi"}]}"#,      // 4
        r#"{"messages": [{"role": "robot", "content": "hi"}]}"#,     // 5
        r#"{"prompt": "q", "response": "a long ."#,                  // 6: not JSON
        "",                                                          // 7: blank, not a record
        r#"{"prompt": "q", "response": "a", "system": "be brief"}"#, // 8: id 6
        GOOD,                                                        // 9: duplicate id 10
    ] {
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
    }
    bytes.extend_from_slice(b"{\"prompt\": \"\xff\"}\n"); // 10: invalid UTF-8
    std::fs::write(&input, bytes).unwrap();
    let out = dir.path().join("out.jsonl");
    let rejects = dir.path().join("rejects.jsonl");
    let o = prepare(
        &model,
        &input,
        &out,
        &["--rejects", rejects.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    for expected in [
        "line 3: empty conversation",
        "line 4: no assistant turn",
        "line 5: message 0: unknown role \"robot\"",
        "line 6: not valid JSON",
        "line 9: duplicate id 10 (first at line 1)",
        "line 10: invalid UTF-8 at byte 12",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
    let ids: Vec<i64> = read_jsonl(&out)
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [10, 1, 6]);
    let rejected: Vec<String> = read_jsonl(&rejects)
        .iter()
        .map(|r| r["location"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        rejected,
        ["line 3", "line 4", "line 5", "line 6", "line 9", "line 10"]
    );
    assert!(err.contains("dropped           6"), "{err}");
}

#[test]
fn strict_stops_at_the_first_bad_record_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        format!("{GOOD}\n{{\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}\n"),
    )
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let o = prepare(&model, &input, &out, &["--strict"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("in.jsonl: line 2: no assistant turn"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "no temporary file may stay behind"
    );
}

#[test]
fn truncates_or_skips_samples_over_max_seq_len() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        format!("{GOOD}\n{{\"prompt\": \"q\", \"response\": \"a\"}}\n"),
    )
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let o = prepare(&model, &input, &out, &["--max-seq-len", "8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = read_jsonl(&out);
    assert_eq!(ints(&rows[0]["input_ids"]).len(), 8);
    assert_eq!(ints(&rows[0]["loss_mask"]), [0, 0, 0, 0, 0, 0, 1, 1]);
    assert!(stderr(&o).contains("truncated         1"), "{}", stderr(&o));

    let o = prepare(
        &model,
        &input,
        &out,
        &["--max-seq-len", "8", "--overlong", "skip"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(read_jsonl(&out).len(), 1);
    assert!(
        stderr(&o).contains("line 1: 9 tokens, longer than --max-seq-len 8"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn refuses_a_model_without_a_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    std::fs::remove_file(model.join("chat_template.jinja")).unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, format!("{GOOD}\n")).unwrap();
    let o = prepare(&model, &input, &dir.path().join("o.jsonl"), &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no chat template"), "{}", stderr(&o));
}

#[test]
fn fails_without_output_when_no_record_is_usable() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, "{\"messages\": []}\n").unwrap();
    let out = dir.path().join("o.jsonl");
    let o = prepare(&model, &input, &out, &[]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("no usable conversation"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
}

#[test]
fn parquet_output_is_what_capture_reads() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        format!("{GOOD}\n{{\"prompt\": \"q\", \"response\": \"a\"}}\n"),
    )
    .unwrap();
    for name in ["out.parquet", "out.jsonl"] {
        let out = dir.path().join(name);
        let o = prepare(&model, &input, &out, &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let limits = hslake_capture::InputLimits::new(WORDS.len(), None, Default::default());
        let inputs = hslake_capture::read_inputs(&out, limits).unwrap();
        assert!(inputs.ids_from_input);
        let got: Vec<(u64, usize, u32)> = inputs
            .samples
            .iter()
            .map(|s| {
                (
                    s.sample_id,
                    s.input_ids.len(),
                    s.loss_mask.iter().map(|&m| m as u32).sum(),
                )
            })
            .collect();
        assert_eq!(got, [(10, 9, 3), (1, 8, 2)], "{name}");
    }
}

// A folder with the tiny model and an input of one good record.
fn with_good_input() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, format!("{GOOD}\n")).unwrap();
    (dir, model, input)
}

// How long starting the binary takes on this machine (a loaded CI runner can take seconds), so
// that a refusal's own time is told apart from it.
fn startup() -> Duration {
    static STARTUP: OnceLock<Duration> = OnceLock::new();
    *STARTUP.get_or_init(|| {
        let t = Instant::now();
        assert!(hslake(&["--version"]).status.success());
        t.elapsed()
    })
}

// Every file under `dir`, with its kind and size, to show that a refused run wrote nothing.
fn listing(dir: &Path) -> Vec<(PathBuf, bool, u64)> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = std::fs::symlink_metadata(e.path()).unwrap();
        if m.is_dir() && !m.file_type().is_symlink() {
            out.extend(listing(&e.path()));
        }
        out.push((e.path(), m.is_file(), m.len()));
    }
    out.sort();
    out
}

// `hslake prepare` with `extra` must exit with status 1 at once, say `message`, and write nothing
// under `dir`.
fn refused_at_once(
    dir: &Path,
    model: &Path,
    input: &Path,
    output: &Path,
    extra: &[&str],
    message: &str,
) {
    let before = listing(dir);
    let base = startup();
    let t = Instant::now();
    let o = prepare(model, input, output, extra);
    let took = t.elapsed();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
    assert!(
        err.contains(message),
        "{extra:?}: missing {message:?} in:\n{err}"
    );
    assert!(
        took < base + Duration::from_secs(2),
        "{extra:?}: refused after {took:?}; starting the binary takes {base:?}"
    );
    assert_eq!(listing(dir), before, "{extra:?}: something was written");
}

#[test]
fn refuses_max_seq_len_0_and_zero_bounds_at_once() {
    let (dir, model, input) = with_good_input();
    let out = dir.path().join("out.jsonl");
    for (flag, message) in [
        (
            "--max-seq-len",
            "--max-seq-len: must be at least 1; a sample of 0 tokens holds nothing to capture",
        ),
        (
            "--max-record-bytes",
            "--max-record-bytes: must be at least 1",
        ),
        ("--max-turns", "--max-turns: must be at least 1"),
        ("--template-fuel", "--template-fuel: must be at least 1"),
    ] {
        refused_at_once(dir.path(), &model, &input, &out, &[flag, "0"], message);
    }
}

#[test]
fn refuses_an_output_that_is_a_directory_a_link_a_device_or_the_input() {
    let (dir, model, input) = with_good_input();
    let none: &[&str] = &[];
    refused_at_once(
        dir.path(),
        &model,
        &input,
        &model,
        none,
        "is a directory; expected a file path",
    );

    let target = dir.path().join("precious.jsonl");
    std::fs::write(&target, "keep me\n").unwrap();
    let link = dir.path().join("link.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    refused_at_once(
        dir.path(),
        &model,
        &input,
        &link,
        none,
        "is a symbolic link (to ",
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me\n");

    // A pipe stands for /dev/full and other device nodes: renaming into place replaced them.
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    refused_at_once(
        dir.path(),
        &model,
        &input,
        &fifo,
        none,
        "is not a regular file",
    );
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());

    refused_at_once(dir.path(), &model, &input, &input, none, "is the input");
    // Also through a hard link, a file:// URL and as the --rejects file.
    let hard = dir.path().join("hard.jsonl");
    std::fs::hard_link(&input, &hard).unwrap();
    refused_at_once(dir.path(), &model, &input, &hard, none, "is the input");
    let url = format!("file://{}", input.display());
    let before = listing(dir.path());
    let o = hslake(&[
        "prepare",
        "--model",
        model.to_str().unwrap(),
        "--input",
        &url,
        "--output",
        input.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("is the input"), "{}", stderr(&o));
    assert_eq!(listing(dir.path()), before);
    let out = dir.path().join("out.jsonl");
    refused_at_once(
        dir.path(),
        &model,
        &input,
        &out,
        &["--rejects", input.to_str().unwrap()],
        "--rejects",
    );
    refused_at_once(
        dir.path(),
        &model,
        &input,
        &out,
        &["--rejects", out.to_str().unwrap()],
        "is also --output",
    );
    assert_eq!(
        std::fs::read_to_string(&input).unwrap(),
        format!("{GOOD}\n")
    );
}

#[test]
fn refuses_template_kwargs_that_replace_the_conversation_at_once() {
    let (dir, model, input) = with_good_input();
    let out = dir.path().join("out.jsonl");
    let kwargs = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    refused_at_once(
        dir.path(),
        &model,
        &input,
        &out,
        &["--chat-template-kwargs", kwargs],
        "--chat-template-kwargs: sets \"messages\", which hslake passes to the template itself",
    );
    refused_at_once(
        dir.path(),
        &model,
        &input,
        &out,
        &[
            "--chat-template-kwargs",
            r#"{"add_generation_prompt": true}"#,
        ],
        "sets \"add_generation_prompt\"",
    );
}

#[test]
fn refuses_an_input_without_line_breaks() {
    // /dev/zero: one endless line, which grew to an 8 GB allocation and aborted.
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = dir.path().join("out.jsonl");
    let o = prepare(&model, Path::new("/dev/zero"), &out, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("/dev/zero: line 1: longer than 268435456 bytes without a line break; expected one JSON object per line"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "only the model"
    );
}

#[test]
fn leaves_out_records_over_the_byte_and_turn_bounds_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let input = dir.path().join("in.jsonl");
    let turn = |i: usize| {
        let role = ["user", "assistant"][i % 2];
        format!(r#"{{"role": "{role}", "content": "hi"}}"#)
    };
    let turns = |n: usize| (0..n).map(turn).collect::<Vec<_>>().join(", ");
    let lines = [
        GOOD.to_string(),
        // One 3,000-byte word: a 20 MB one took 2 GB to tokenize.
        format!(r#"{{"prompt": "q", "response": "{}"}}"#, "a".repeat(3000)),
        format!(r#"{{"messages": [{}]}}"#, turns(6)),
        // Under the bound as text, over it once rendered.
        format!(r#"{{"prompt": "q", "response": "{}"}}"#, "a".repeat(1990)),
        format!(r#"{{"messages": [{}]}}"#, turns(5000)),
    ];
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = dir.path().join("out.jsonl");
    let o = prepare(
        &model,
        &input,
        &out,
        &["--max-record-bytes", "2000", "--max-turns", "4"],
    );
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    for expected in [
        "line 2: the messages' text is over --max-record-bytes 2000 (3001 bytes)",
        "line 3: 6 messages, more than --max-turns 4",
        "line 4: the rendered text is over --max-record-bytes 2000",
        "line 5: 5000 messages, more than --max-turns 4",
    ] {
        assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
    }
    for (reason, n) in [("over --max-record-bytes", 2), ("over --max-turns", 2)] {
        assert!(err.contains(&format!("    {reason:<28} {n}\n")), "{err}");
    }
    assert_eq!(read_jsonl(&out).len(), 1);
}

#[test]
fn leaves_out_records_whose_rendering_runs_out_of_fuel_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    // A template that doubles a string 40 times (2^40 bytes aborted the process) or loops 10^12
    // times (ran until killed) for some records, and renders the others as ChatML.
    let hostile = format!(
        "{{% if messages[0]['content'] == 'double' %}}{{% set ns = namespace(s='x') %}}{{% for i in range(40) %}}{{% set ns.s = ns.s ~ ns.s %}}{{% endfor %}}{{{{ ns.s | length }}}}\
         {{% elif messages[0]['content'] == 'loop' %}}{{% for i in range(10000) %}}{{% for j in range(10000) %}}{{% for k in range(10000) %}}{{% endfor %}}{{% endfor %}}{{% endfor %}}\
         {{% else %}}{TEMPLATE}{{% endif %}}"
    );
    std::fs::write(model.join("chat_template.jinja"), hostile).unwrap();
    let input = dir.path().join("in.jsonl");
    let record = |q: &str| format!(r#"{{"prompt": "{q}", "response": "hello"}}"#);
    std::fs::write(
        &input,
        [record("double"), record("loop"), GOOD.into()].join("\n") + "\n",
    )
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let o = prepare(&model, &input, &out, &["--template-fuel", "200000"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    for line in ["line 1", "line 2"] {
        assert!(
            err.contains(&format!(
                "{line}: chat template ran out of fuel: one rendering may take 200000"
            )),
            "{err}"
        );
    }
    assert!(
        err.contains(&format!("    {:<28} 2\n", "template out of fuel")),
        "{err}"
    );
    assert_eq!(read_jsonl(&out).len(), 1);
}

#[test]
fn removes_temporary_files_runs_that_did_not_finish_left_and_no_others() {
    let (dir, model, input) = with_good_input();
    let out = dir.path().join("out.jsonl");
    // What an aborted run leaves, one that a running one holds, and a file of the user's.
    let abandoned = dir.path().join(".out.jsonl.hslake-AbC123.tmp");
    let running = dir.path().join(".out.jsonl.hslake-XyZ789.tmp");
    let users = dir.path().join(".out.jsonl.mine.tmp");
    for p in [&abandoned, &running, &users] {
        std::fs::write(p, "partial").unwrap();
    }
    let held = std::fs::File::open(&running).unwrap();
    held.lock().unwrap();
    let o = prepare(&model, &input, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!abandoned.exists());
    assert!(running.exists() && users.exists());
    assert_eq!(read_jsonl(&out).len(), 1);
}
