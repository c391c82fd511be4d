//! End-to-end: `hslake prepare` on a tiny word-level model — loss masks, every kind of bad record
//! named by line and left out, `--strict`, `--max-seq-len`, Parquet in and out, and outputs that
//! `hslake capture` reads.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

fn hslake(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hslake"))
        .args(args)
        .env("HSLAKE_LOG", "warn")
        .output()
        .expect("run hslake")
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
        let limits = hslake_capture::input::InputLimits {
            vocab_size: WORDS.len(),
            max_seq_len: None,
            overlong: Default::default(),
        };
        let inputs = hslake_capture::input::read_inputs(&out, limits).unwrap();
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
