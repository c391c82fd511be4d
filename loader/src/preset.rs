//! Named trainer presets: which capture points an EAGLE-3 trainer consumes, in which order,
//! for a model of `n` decoder layers.
//!
//! Both trainers take the same three auxiliary layers, `1, n/2 − 1, n − 4` in hslake numbering
//! (layer `i` is the output of decoder layer `i`, HF `hidden_states[i + 1]`):
//!
//! - speculators 0.9.0 names them by vLLM ids `[2, n/2, n − 3]` (id `k` = HF
//!   `hidden_states[k]`, one more than hslake's index) and adds id `n`, the last layer's output
//!   **before** the final norm; its draft applies the verifier's norm itself. Target:
//!   `layer_{n−1}`.
//! - SpecForge 0.2.0 uses `[1, n/2 − 1, n − 4]` (SGLang ids: output of layer `k`, the same
//!   numbers as hslake's) and stores the state **after** the final norm. Target: `final_norm`.
//!
//! A dataset holding the three auxiliary layers, `layer_{n−1}` and `final_norm` serves both.
use std::fmt;
use std::str::FromStr;

use hslake_schemas::{CapturePoint, DatasetSchema};
use serde::{Deserialize, Serialize};

use crate::LoaderError;

/// A trainer's layer convention.
// Deserialized through `FromStr` so that options JSON and the CLI name the same choices in the
// same words ("unknown preset ...; expected one of ...").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", try_from = "String")]
pub enum Preset {
    /// speculators (vLLM hidden states): aux layers `1, n/2 − 1, n − 4`, target `layer_{n−1}`.
    Speculators,
    /// SpecForge (SGLang hidden states): aux layers `1, n/2 − 1, n − 4`, target `final_norm`.
    Specforge,
}

/// The capture points a preset resolves to for one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresetPoints {
    /// Auxiliary points, in the order the trainer concatenates them.
    pub aux: Vec<CapturePoint>,
    /// The target point.
    pub target: CapturePoint,
}

impl PresetPoints {
    /// Every point the preset needs: the auxiliary ones, then the target.
    pub fn all(&self) -> Vec<CapturePoint> {
        let mut v = self.aux.clone();
        v.push(self.target);
        v
    }
}

impl Preset {
    /// The preset called `name` (case and surrounding space ignored).
    fn named(name: &str) -> Result<Self, String> {
        let wanted = name.trim().to_ascii_lowercase();
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == wanted)
            .ok_or_else(|| {
                format!(
                    "unknown preset {name:?}; expected one of {}",
                    Preset::ALL.map(|p| p.name()).join(", ")
                )
            })
    }

    /// Every preset, for listings in error messages.
    pub const ALL: [Preset; 2] = [Preset::Speculators, Preset::Specforge];

    /// The name used on the command line and in Python (`speculators`, `specforge`).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Speculators => "speculators",
            Preset::Specforge => "specforge",
        }
    }

    /// Whether the target is taken after the model's final norm.
    pub fn post_norm_target(self) -> bool {
        matches!(self, Preset::Specforge)
    }

    /// The points this preset needs for a model of `num_layers` decoder layers.
    pub fn points(self, num_layers: usize) -> Result<PresetPoints, LoaderError> {
        let n = num_layers;
        // Both trainers' defaults collapse to repeated layers below 7 layers (n = 6 gives
        // 1, 2, 2), which neither accepts.
        if n < 7 {
            return Err(LoaderError::Config(format!(
                "preset {}: a model of {n} layers is too small; its default aux layers \
                 [1, n/2-1, n-4] = {:?} must be distinct, which needs at least 7 layers",
                self.name(),
                aux_layers(n)
            )));
        }
        let aux = aux_layers(n)
            .into_iter()
            .map(|l| CapturePoint::LayerOutput(l as u32))
            .collect();
        let target = match self {
            Preset::Speculators => CapturePoint::LayerOutput((n - 1) as u32),
            Preset::Specforge => CapturePoint::FinalNorm,
        };
        Ok(PresetPoints { aux, target })
    }

    /// The points for a dataset, each checked to be present: a missing one is a
    /// [`LoaderError::PresetMismatch`] that lists what is missing, what the dataset holds, and
    /// how to capture what the trainer needs.
    pub fn resolve(self, url: &str, schema: &DatasetSchema) -> Result<PresetPoints, LoaderError> {
        let p = self.points(schema.num_layers)?;
        let missing: Vec<CapturePoint> = p
            .all()
            .into_iter()
            .filter(|&q| schema.point_index(q).is_none())
            .collect();
        if missing.is_empty() {
            return Ok(p);
        }
        let n = schema.num_layers;
        let mut hint = format!(
            "{} needs aux layers {} and target {} ({}) for a {n}-layer model; capture them with \
             `hslake capture --layers 1,{},{},{} --final-norm`, which serves both presets",
            self.name(),
            columns(&p.aux),
            p.target.column(),
            if self.post_norm_target() {
                "after the final norm"
            } else {
                "the last layer's output before the final norm"
            },
            n / 2 - 1,
            n - 4,
            n - 1,
        );
        // The one mix-up that keeps the shapes right but trains on the wrong target.
        let has_final = schema.point_index(CapturePoint::FinalNorm).is_some();
        let has_last = schema
            .point_index(CapturePoint::LayerOutput((n - 1) as u32))
            .is_some();
        match self {
            Preset::Speculators if has_final && !has_last => hint.push_str(&format!(
                "; the dataset's final_norm is after the norm, which speculators applies itself, \
                 so it cannot stand in for layer_{}",
                n - 1
            )),
            Preset::Specforge if has_last && !has_final => hint.push_str(&format!(
                "; the dataset's layer_{} is before the final norm, which SpecForge expects applied",
                n - 1
            )),
            _ => {}
        }
        Err(LoaderError::PresetMismatch {
            preset: self.name(),
            url: url.to_string(),
            missing: columns(&missing),
            available: columns(&schema.points),
            hint,
        })
    }
}

fn aux_layers(n: usize) -> Vec<usize> {
    vec![1, (n / 2).saturating_sub(1), n.saturating_sub(4)]
}

fn columns(points: &[CapturePoint]) -> String {
    points
        .iter()
        .map(|p| p.column())
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl TryFrom<String> for Preset {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Preset::named(&s)
    }
}

impl FromStr for Preset {
    type Err = LoaderError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::named(s).map_err(LoaderError::Config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hslake_schemas::DType;

    fn schema(n: usize, points: Vec<CapturePoint>) -> DatasetSchema {
        DatasetSchema::new("m", "LlamaForCausalLM", 8, n, 100, DType::Bf16, points).unwrap()
    }

    fn layers(ls: &[u32]) -> Vec<CapturePoint> {
        ls.iter().map(|&l| CapturePoint::LayerOutput(l)).collect()
    }

    #[test]
    fn smollm2_layers_for_both_trainers() {
        // SmolLM2-135M: 30 layers; vLLM ids [2, 15, 27, 30] are hslake layers 1, 14, 26, 29.
        let s = Preset::Speculators.points(30).unwrap();
        assert_eq!(s.aux, layers(&[1, 14, 26]));
        assert_eq!(s.target, CapturePoint::LayerOutput(29));
        let f = Preset::Specforge.points(30).unwrap();
        assert_eq!(f.aux, layers(&[1, 14, 26]));
        assert_eq!(f.target, CapturePoint::FinalNorm);
    }

    #[test]
    fn seed_deployment_layers_for_a_61_layer_model() {
        let s = Preset::Speculators.points(61).unwrap();
        assert_eq!(s.aux, layers(&[1, 29, 57]));
        assert_eq!(s.target, CapturePoint::LayerOutput(60));
    }

    #[test]
    fn rejects_model_too_small_for_distinct_aux_layers() {
        let err = Preset::Specforge.points(6).unwrap_err().to_string();
        assert!(err.contains("at least 7 layers"), "{err}");
        assert!(Preset::Specforge.points(7).is_ok());
    }

    #[test]
    fn resolves_when_every_point_is_captured() {
        let mut pts = layers(&[1, 3, 4, 7]);
        pts.push(CapturePoint::FinalNorm);
        let s = schema(8, pts);
        assert_eq!(
            Preset::Speculators.resolve("u", &s).unwrap().target,
            CapturePoint::LayerOutput(7)
        );
        assert_eq!(
            Preset::Specforge.resolve("u", &s).unwrap().target,
            CapturePoint::FinalNorm
        );
    }

    #[test]
    fn speculators_refuses_final_norm_in_place_of_the_pre_norm_last_layer() {
        let mut pts = layers(&[1, 3, 4]);
        pts.push(CapturePoint::FinalNorm);
        let err = Preset::Speculators
            .resolve("file:///ds", &schema(8, pts))
            .unwrap_err()
            .to_string();
        assert!(err.contains("preset speculators"), "{err}");
        assert!(err.contains("missing layer_7"), "{err}");
        assert!(err.contains("cannot stand in for layer_7"), "{err}");
        assert!(err.contains("--layers 1,3,4,7 --final-norm"), "{err}");
    }

    #[test]
    fn specforge_names_every_missing_point() {
        let err = Preset::Specforge
            .resolve("file:///ds", &schema(8, layers(&[1, 7])))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("missing layer_3, layer_4, final_norm"),
            "{err}"
        );
        assert!(err.contains("holds layer_1, layer_7"), "{err}");
        assert!(err.contains("before the final norm"), "{err}");
    }

    #[test]
    fn parses_names_and_rejects_unknown_ones() {
        assert_eq!("SpecForge".parse::<Preset>().unwrap(), Preset::Specforge);
        assert_eq!(
            "speculators".parse::<Preset>().unwrap(),
            Preset::Speculators
        );
        let err = "eagle".parse::<Preset>().unwrap_err().to_string();
        assert!(
            err.contains("expected one of speculators, specforge"),
            "{err}"
        );
    }
}
