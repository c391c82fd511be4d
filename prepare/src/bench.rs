//! Where `hslake prepare`'s time goes: each stage of the prepare path run alone on one thread
//! over the same conversations, in CPU microseconds per conversation (`hslake bench prepare`).
use std::path::Path;
use std::time::Instant;

use hslake_store::tools::bench::cpu_seconds;

use crate::chat_tokenizer::{ChatTokenizer, LossOn, TemplateKwargs};
use crate::conversation::Conversation;
use crate::encode::Encoder;
use crate::error::{PrepareError, Result};
use crate::limits::Limits;
use crate::mask::token_mask;
use crate::output::{Sample, SampleWriter};
use crate::source::{read_conversations, FileFormat};
use crate::template::ChatTemplate;

/// One stage's cost.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stage {
    /// What was timed.
    pub name: String,
    /// CPU microseconds per conversation.
    pub cpu_us: f64,
    /// Wall microseconds per conversation.
    pub wall_us: f64,
}

fn timed(name: &str, n: usize, f: impl FnOnce() -> Result<()>) -> Result<Stage> {
    let (wall, cpu) = (Instant::now(), cpu_seconds());
    f()?;
    let per = |s: f64| s * 1e6 / n.max(1) as f64;
    Ok(Stage {
        name: name.into(),
        cpu_us: per(cpu_seconds() - cpu),
        wall_us: per(wall.elapsed().as_secs_f64()),
    })
}

fn record_err(e: crate::error::RecordError) -> PrepareError {
    PrepareError::Input {
        path: "benchmark input".into(),
        message: e.to_string(),
    }
}

/// Times each stage over the conversations of `input` that tokenize without error.
pub fn bench_stages(model_dir: &Path, input: &Path, kwargs: &TemplateKwargs) -> Result<Vec<Stage>> {
    let mut out = vec![];
    let mut convs: Vec<Conversation> = vec![];
    let mut n = 0;
    out.push(timed("read and parse JSONL", 1, || {
        for r in read_conversations(input)? {
            n += 1;
            if let Ok(c) = r?.conversation {
                convs.push(c);
            }
        }
        Ok(())
    })?);
    // Per conversation, like every other stage.
    out[0].cpu_us /= n.max(1) as f64;
    out[0].wall_us /= n.max(1) as f64;
    let tok =
        ChatTokenizer::from_model_dir(model_dir, LossOn::Assistant, kwargs, Limits::default())?;
    convs.retain(|c| tok.tokenize(c).is_ok());
    let n = convs.len();

    let mut texts = vec![];
    out.push(timed("render the conversation (minijinja)", n, || {
        for c in &convs {
            texts.push(tok.render(c).map_err(record_err)?);
        }
        Ok(())
    })?);
    let mut rendered_spans = vec![];
    out.push(timed(
        &format!(
            "assistant spans ({}, every prefix rendered)",
            tok.mask_method()
        ),
        n,
        || {
            for (c, text) in convs.iter().zip(&texts) {
                let values = ChatTemplate::message_values(&c.messages).map_err(record_err)?;
                rendered_spans.push(
                    tok.assistant_spans(text, c, &values, false)
                        .map_err(record_err)?,
                );
            }
            Ok(())
        },
    )?);
    let mut spans = vec![];
    out.push(timed(
        &format!(
            "assistant spans ({}, {})",
            tok.mask_method(),
            tok.prefix_renderings()
        ),
        n,
        || {
            for (c, text) in convs.iter().zip(&texts) {
                let values = ChatTemplate::message_values(&c.messages).map_err(record_err)?;
                spans.push(
                    tok.assistant_spans(text, c, &values, true)
                        .map_err(record_err)?,
                );
            }
            Ok(())
        },
    )?);
    // The two ways must agree on every conversation.
    if let Some(i) = (0..n).find(|&i| spans[i] != rendered_spans[i]) {
        return Err(PrepareError::Input {
            path: input.to_path_buf(),
            message: format!("conversation {i}: filled skeletons give assistant spans {:?}, rendering every prefix {:?}", spans[i], rendered_spans[i]),
        });
    }
    let tokenizer = tok.tokenizer();
    let tk_err =
        |e: tokenizers::Error| record_err(crate::error::RecordError::Tokenize(e.to_string()));
    out.push(timed("tokenizers encode_char_offsets (before)", n, || {
        for text in &texts {
            tokenizer
                .encode_char_offsets(text.as_str(), false)
                .map_err(tk_err)?;
        }
        Ok(())
    })?);
    out.push(timed("tokenizers encode_fast (no offsets)", n, || {
        for text in &texts {
            tokenizer
                .encode_fast(text.as_str(), false)
                .map_err(tk_err)?;
        }
        Ok(())
    })?);
    // A new encoder starts with an empty piece cache.
    let encoder = Encoder::new(tokenizer);
    let mut encoded = vec![];
    for pass in ["first pass", "second pass"] {
        encoded.clear();
        out.push(timed(
            &format!("hslake encoder, {} ({pass})", encoder.path()),
            n,
            || {
                for text in &texts {
                    encoded.push(encoder.encode(tokenizer, text).map_err(record_err)?);
                }
                Ok(())
            },
        )?);
    }
    out.push(timed("loss mask from offsets", n, || {
        for (e, s) in encoded.iter().zip(&spans) {
            token_mask(&e.offsets, s);
        }
        Ok(())
    })?);
    let mut samples = vec![];
    out.push(timed("tokenize: all of the above", n, || {
        for (i, c) in convs.iter().enumerate() {
            let t = tok.tokenize(c).map_err(record_err)?;
            samples.push(Sample {
                id: i as u64,
                input_ids: t.input_ids,
                loss_mask: t.loss_mask,
            });
        }
        Ok(())
    })?);
    let dir = tempfile::tempdir().map_err(|e| PrepareError::Io {
        path: std::env::temp_dir(),
        source: e,
    })?;
    out.push(timed("write JSONL", n, || {
        let mut w = SampleWriter::create(&dir.path().join("out.jsonl"), FileFormat::Jsonl)?;
        for s in samples.drain(..) {
            w.write(s)?;
        }
        w.finish()
    })?);
    Ok(out)
}
