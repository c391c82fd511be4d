//! The one table of implemented architectures: which `architectures` / `model_type` names of
//! a `config.json` map to which family's config parser. A family's parsed config knows how to
//! load its model, so adding an architecture is one new file under `models/` and one entry here.
//! A multimodal wrapper that nests its language model under `text_config` is an entry whose
//! parser reads that section and hands it to the inner family's parser.
use std::path::Path;

use super::hf_config::ConfigFile;
use super::{deepseek_v3, llama, mistral, qwen2, qwen3, qwen3_moe, ModelConfig};
use crate::error::{CaptureError, Result};
use crate::quant::config::Quantization;

/// One implemented architecture.
struct Entry {
    /// Hugging Face class names (`architectures[0]`) it accepts; the first is its own.
    architectures: &'static [&'static str],
    /// `model_type` values that name it when `architectures` is absent.
    model_types: &'static [&'static str],
    /// Reads and validates its config.
    parse: fn(&ConfigFile) -> Result<Box<dyn ModelConfig>>,
}

const ENTRIES: &[Entry] = &[
    Entry {
        architectures: &["LlamaForCausalLM"],
        model_types: &["llama"],
        parse: llama::parse,
    },
    Entry {
        architectures: &["MistralForCausalLM"],
        model_types: &["mistral"],
        parse: mistral::parse,
    },
    Entry {
        architectures: &["Qwen2ForCausalLM"],
        model_types: &["qwen2"],
        parse: qwen2::parse,
    },
    Entry {
        architectures: &["Qwen3ForCausalLM"],
        model_types: &["qwen3"],
        parse: qwen3::parse,
    },
    Entry {
        architectures: &["Qwen3MoeForCausalLM"],
        model_types: &["qwen3_moe"],
        parse: qwen3_moe::parse,
    },
    Entry {
        architectures: &["DeepseekV3ForCausalLM"],
        model_types: &["deepseek_v3", "kimi_k2"],
        parse: deepseek_v3::parse,
    },
    Entry {
        architectures: &["KimiK25ForConditionalGeneration"],
        model_types: &["kimi_k25"],
        parse: deepseek_v3::parse_kimi_k25,
    },
];

/// Reads `<dir>/config.json` and converts it into its architecture's validated config (tests
/// that need no weight format).
#[cfg(test)]
pub(crate) fn read_config(dir: &Path) -> Result<Box<dyn ModelConfig>> {
    Ok(read_model(dir)?.0)
}

/// Reads `<dir>/config.json`: its architecture's validated config and how its linear weights
/// are stored (`quantization_config`).
pub(crate) fn read_model(dir: &Path) -> Result<(Box<dyn ModelConfig>, Quantization)> {
    let file = ConfigFile::read(dir)?;
    let config = (entry_for(&file)?.parse)(&file)?;
    let quant = Quantization::from_config(&file.json).map_err(|message| CaptureError::Config {
        path: file.path.clone(),
        message,
    })?;
    Ok((config, quant))
}

/// The entry `architectures[0]` names, else the one `model_type` names.
fn entry_for(file: &ConfigFile) -> Result<&'static Entry> {
    let (name, found) = match (file.architecture(), file.model_type()) {
        (Some(name), _) => (
            name,
            ENTRIES.iter().find(|e| e.architectures.contains(&name)),
        ),
        (None, Some(t)) => (t, ENTRIES.iter().find(|e| e.model_types.contains(&t))),
        (None, None) => ("<no architectures and no model_type>", None),
    };
    found.ok_or_else(|| CaptureError::UnknownArchitecture {
        name: name.to_string(),
        supported: ENTRIES
            .iter()
            .map(|e| e.architectures[0])
            .collect::<Vec<_>>()
            .join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test config with `names` added, its decoder fields also nested as a wrapper's
    /// `text_config` (which the other families ignore).
    fn parse(names: serde_json::Value) -> Result<Box<dyn ModelConfig>> {
        let mut f = ConfigFile::for_test(names);
        let text = ConfigFile::for_test(serde_json::json!({})).json;
        f.json["text_config"] = text;
        (entry_for(&f)?.parse)(&f)
    }

    #[test]
    fn every_entry_parses_to_its_own_architecture_by_either_name() {
        for e in ENTRIES {
            let by_class = parse(serde_json::json!({"architectures": [e.architectures[0]]}));
            assert_eq!(by_class.unwrap().info().architecture, e.architectures[0]);
            for t in e.model_types {
                let by_type = parse(serde_json::json!({ "model_type": t }));
                assert_eq!(by_type.unwrap().info().architecture, e.architectures[0]);
            }
        }
    }

    #[test]
    fn names_unknown_architecture_and_the_supported_ones() {
        let e =
            parse(serde_json::json!({"architectures": ["GPT2LMHeadModel"], "model_type": "llama"}))
                .unwrap_err()
                .to_string();
        assert_eq!(
            e,
            "unknown architecture \"GPT2LMHeadModel\"; supported: LlamaForCausalLM, \
             MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, \
             DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration"
        );
        let e = parse(serde_json::json!({})).unwrap_err().to_string();
        assert!(e.contains("<no architectures and no model_type>"), "{e}");
    }
}
