//! A checkpoint's `quantization_config` read once: which scheme (FP8 blocks, INT4 groups) and,
//! for compressed-tensors, which linears it quantizes (`targets`, `ignore`).
use regex::Regex;

/// How a checkpoint's linear weights are stored, from `config.json`'s `quantization_config`.
#[derive(Debug, Clone, Default)]
pub(crate) enum Quantization {
    /// Every weight in a float dtype (no `quantization_config`).
    #[default]
    None,
    /// DeepSeek-V3's float8_e4m3fn weights with one f32 scale per `block` tile.
    Fp8Block {
        /// `weight_block_size`: rows, columns of one scale's tile.
        block: [usize; 2],
    },
    /// compressed-tensors `pack-quantized` symmetric int4, one scale per `group_size` inputs.
    Int4Group {
        /// Inputs sharing one scale.
        group_size: usize,
        /// Modules quantized (`targets` of the config groups).
        targets: Vec<ModulePattern>,
        /// Modules left unquantized even if targeted.
        ignore: Vec<ModulePattern>,
    },
}

/// One entry of compressed-tensors' `targets` / `ignore`: a module name, `re:` and a regular
/// expression matched at the start of the name (Python's `re.match`), or a class name.
#[derive(Debug, Clone)]
pub(crate) enum ModulePattern {
    /// An exact module name, or a class name (every module we read through here is a
    /// `Linear`, so the class name `Linear` matches them all).
    Name(String),
    /// `re:<expr>`, anchored at the start of the module name.
    Regex(Regex),
}

impl ModulePattern {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        match s.strip_prefix("re:") {
            Some(expr) => Regex::new(&format!("^(?:{expr})"))
                .map(ModulePattern::Regex)
                .map_err(|e| format!("pattern {s:?} is not a regular expression: {e}")),
            None => Ok(ModulePattern::Name(s.to_string())),
        }
    }

    /// As a `targets` entry: the module's name, or its class.
    fn matches(&self, module: &str) -> bool {
        match self {
            ModulePattern::Name(n) => n == module || n == "Linear",
            ModulePattern::Regex(r) => r.is_match(module),
        }
    }

    /// As an `ignore` entry: the module's name only (a class name there would ignore every
    /// linear, which no published config means).
    fn matches_exactly(&self, module: &str) -> bool {
        match self {
            ModulePattern::Name(n) => n == module,
            ModulePattern::Regex(r) => r.is_match(module),
        }
    }
}

/// What this crate reads; named in every refusal.
const SUPPORTED: &str = "supported: quant_method \"fp8\" with weight_block_size (DeepSeek-V3 \
     FP8 blocks) and \"compressed-tensors\" with format \"pack-quantized\" (4-bit symmetric int \
     groups)";

impl Quantization {
    /// Reads `quantization_config` of `json` (a config.json, or a wrapper's, whose
    /// `text_config` may hold it instead); `Err` says what is wrong and what is supported.
    pub fn from_config(json: &serde_json::Value) -> std::result::Result<Self, String> {
        let section = json
            .get("quantization_config")
            .or_else(|| json.get("text_config")?.get("quantization_config"));
        let Some(q) = section.filter(|q| !q.is_null()) else {
            return Ok(Quantization::None);
        };
        let text = |key: &str| q.get(key).and_then(|v| v.as_str());
        match text("quant_method") {
            Some("fp8") => parse_fp8(q),
            Some("compressed-tensors") => parse_compressed(q),
            Some(other) => Err(format!(
                "quantization_config.quant_method = {other:?} is not supported; {SUPPORTED}"
            )),
            None => Err(format!(
                "quantization_config has no quant_method; {SUPPORTED}"
            )),
        }
    }

    /// The scheme as the manifest's provenance records it; `None` for float weights.
    pub fn describe(&self) -> Option<String> {
        match self {
            Quantization::None => None,
            Quantization::Fp8Block { block } => Some(format!(
                "fp8 e4m3 block-quantized, weight_block_size [{}, {}], weight_scale_inv",
                block[0], block[1]
            )),
            Quantization::Int4Group { group_size, .. } => Some(format!(
                "compressed-tensors pack-quantized int4 symmetric, group_size {group_size}"
            )),
        }
    }

    /// Whether the config quantizes linear `module` to INT4.
    pub(crate) fn int4_module(&self, module: &str) -> bool {
        match self {
            Quantization::Int4Group {
                targets, ignore, ..
            } => {
                targets.iter().any(|t| t.matches(module))
                    && !ignore.iter().any(|i| i.matches_exactly(module))
            }
            _ => false,
        }
    }
}

fn parse_fp8(q: &serde_json::Value) -> std::result::Result<Quantization, String> {
    if let Some(fmt) = q.get("fmt").and_then(|v| v.as_str()) {
        if fmt != "e4m3" {
            return Err(format!(
                "quantization_config.fmt = {fmt:?}; only \"e4m3\" FP8 weights are supported"
            ));
        }
    }
    let block = q
        .get("weight_block_size")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<u64>>>());
    match block {
        Some(Some(b)) if b.len() == 2 && b.iter().all(|&d| d > 0) => Ok(Quantization::Fp8Block {
            block: [b[0] as usize, b[1] as usize],
        }),
        _ => Err(format!(
            "quantization_config.weight_block_size = {}; expected two positive integers such \
             as [128, 128] (per-tensor FP8 is not supported)",
            q.get("weight_block_size")
                .map_or("absent".to_string(), |v| v.to_string())
        )),
    }
}

fn parse_compressed(q: &serde_json::Value) -> std::result::Result<Quantization, String> {
    let format = q.get("format").and_then(|v| v.as_str());
    let groups = q
        .get("config_groups")
        .and_then(|g| g.as_object())
        .filter(|g| !g.is_empty())
        .ok_or("compressed-tensors quantization_config has no config_groups")?;
    let mut group_size = None;
    let mut targets = Vec::new();
    for (name, group) in groups {
        let fmt = group.get("format").and_then(|v| v.as_str()).or(format);
        if fmt != Some("pack-quantized") {
            return Err(format!(
                "compressed-tensors config group {name:?} has format {fmt:?}; {SUPPORTED}"
            ));
        }
        let w = group
            .get("weights")
            .filter(|w| w.is_object())
            .ok_or_else(|| format!("config group {name:?} has no \"weights\" arguments"))?;
        let field = |k: &str| w.get(k).cloned().unwrap_or(serde_json::Value::Null);
        let size = field("group_size").as_u64().unwrap_or(0) as usize;
        let expected = [
            ("num_bits", serde_json::json!(4)),
            ("type", serde_json::json!("int")),
            ("symmetric", serde_json::json!(true)),
            ("strategy", serde_json::json!("group")),
        ];
        for (k, want) in expected {
            if field(k) != want {
                return Err(format!(
                    "config group {name:?}: weights.{k} = {}; only {k} = {want} is supported \
                     (4-bit symmetric int weights in groups)",
                    field(k)
                ));
            }
        }
        if size == 0 || !size.is_multiple_of(8) {
            return Err(format!(
                "config group {name:?}: weights.group_size = {}; it must be a positive \
                 multiple of 8 (eight 4-bit values per int32)",
                field("group_size")
            ));
        }
        if group_size.is_some_and(|g| g != size) {
            return Err(format!(
                "config groups with different group sizes ({} and {size}) are not supported",
                group_size.unwrap_or_default()
            ));
        }
        group_size = Some(size);
        let list = group
            .get("targets")
            .and_then(|t| t.as_array())
            .ok_or_else(|| format!("config group {name:?} has no \"targets\" list"))?;
        for t in list {
            let t = t
                .as_str()
                .ok_or_else(|| format!("config group {name:?}: target {t} is not a string"))?;
            targets.push(ModulePattern::parse(t)?);
        }
    }
    let ignore = match q.get("ignore") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .map(|i| {
                i.as_str()
                    .ok_or_else(|| format!("ignore entry {i} is not a string"))
                    .and_then(ModulePattern::parse)
            })
            .collect::<std::result::Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "quantization_config.ignore = {other}; expected a list"
            ))
        }
    };
    Ok(Quantization::Int4Group {
        group_size: group_size.unwrap_or(32),
        targets,
        ignore,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(q: serde_json::Value) -> std::result::Result<Quantization, String> {
        Quantization::from_config(&serde_json::json!({ "quantization_config": q }))
    }

    fn kimi_int4() -> serde_json::Value {
        serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4,
            "type": "int", "symmetric": true, "strategy": "group", "group_size": 32,
            "dynamic": false}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]})
    }

    #[test]
    fn int4_targets_the_routed_experts_and_ignores_what_the_config_names() {
        let q = config(kimi_int4()).unwrap();
        assert!(q.int4_module("model.layers.3.mlp.experts.7.gate_proj"));
        assert!(!q.int4_module("model.layers.3.mlp.shared_experts.up_proj"));
        assert!(!q.int4_module("model.layers.0.mlp.down_proj"));
        assert!(!q.int4_module("model.layers.3.self_attn.q_a_proj"));
        assert_eq!(
            q.describe().unwrap(),
            "compressed-tensors pack-quantized int4 symmetric, group_size 32"
        );
        // Named targets are exact names; `re:` matches from the start of the name only.
        let mut named = kimi_int4();
        named["config_groups"]["group_0"]["targets"] =
            serde_json::json!(["re:model\\.layers\\.1\\.", "model.layers.0.mlp.up_proj"]);
        named["ignore"] = serde_json::json!(["re:layers"]);
        let q = config(named).unwrap();
        assert!(q.int4_module("model.layers.1.mlp.down_proj"));
        assert!(q.int4_module("model.layers.0.mlp.up_proj"));
        assert!(!q.int4_module("model.layers.0.mlp.gate_proj"));
    }

    #[test]
    fn unknown_or_unsupported_schemes_are_named_with_what_is_supported() {
        let e = config(serde_json::json!({"quant_method": "awq", "bits": 4})).unwrap_err();
        assert!(e.starts_with("quantization_config.quant_method = \"awq\" is not supported; supported: quant_method \"fp8\""), "{e}");
        let e = config(serde_json::json!({"quant_method": "fp8", "fmt": "e4m3"})).unwrap_err();
        assert!(e.contains("weight_block_size = absent"), "{e}");
        let mut odd = kimi_int4();
        odd["config_groups"]["group_0"]["weights"]["group_size"] = serde_json::json!(12);
        let e = config(odd).unwrap_err();
        assert!(e.contains("weights.group_size = 12"), "{e}");
        let mut asym = kimi_int4();
        asym["config_groups"]["group_0"]["weights"]["symmetric"] = serde_json::json!(false);
        assert!(config(asym)
            .unwrap_err()
            .contains("weights.symmetric = false"));
        let mut float = kimi_int4();
        float["format"] = serde_json::json!("float-quantized");
        assert!(config(float)
            .unwrap_err()
            .contains("format Some(\"float-quantized\")"));
        let q = config(serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}))
        .unwrap();
        assert!(matches!(q, Quantization::Fp8Block { block: [128, 128] }));
        assert!(matches!(
            Quantization::from_config(&serde_json::json!({})),
            Ok(Quantization::None)
        ));
    }
}
