use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::SchemaError;

/// The layer convention recorded with every dataset (see DESIGN.md, "Layer conventions").
pub const LAYER_CONVENTION: &str =
    "layer_<i> is the residual stream after decoder layer i (0-based), before any final norm; \
     equals Hugging Face output_hidden_states[i + 1] for every layer but the last; \
     final_norm is the last layer's output after the model's final RMSNorm";

/// Where in the model a hidden state was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum CapturePoint {
    /// Output of decoder layer i (0-based): the residual stream after it.
    LayerOutput(u32),
    /// The last layer's output after the final norm.
    FinalNorm,
}

impl CapturePoint {
    /// Column name of this point's tensor: `layer_30` or `final_norm`.
    pub fn column(&self) -> String {
        self.to_string()
    }

    /// Column name of this point's per-token fp8 scales: `layer_30_scale`.
    pub fn scale_column(&self) -> String {
        format!("{self}_scale")
    }

    /// Human wording used in error messages: `layer 30` or `final norm`.
    pub fn label(&self) -> String {
        match self {
            CapturePoint::LayerOutput(i) => format!("layer {i}"),
            CapturePoint::FinalNorm => "final norm".to_string(),
        }
    }

    /// The capture-point kind as written in metadata.
    pub fn kind(&self) -> &'static str {
        match self {
            CapturePoint::LayerOutput(_) => "layer_output",
            CapturePoint::FinalNorm => "final_norm",
        }
    }

    /// The decoder layer index, if any.
    pub fn layer(&self) -> Option<u32> {
        match self {
            CapturePoint::LayerOutput(i) => Some(*i),
            CapturePoint::FinalNorm => None,
        }
    }
}

impl fmt::Display for CapturePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapturePoint::LayerOutput(i) => write!(f, "layer_{i}"),
            CapturePoint::FinalNorm => f.write_str("final_norm"),
        }
    }
}

impl FromStr for CapturePoint {
    type Err = SchemaError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || SchemaError::UnknownCapturePoint {
            name: s.to_string(),
        };
        let t = s.trim();
        if t == "final_norm" {
            return Ok(CapturePoint::FinalNorm);
        }
        let digits = t.strip_prefix("layer_").unwrap_or(t);
        digits
            .parse::<u32>()
            .map(CapturePoint::LayerOutput)
            .map_err(|_| bad())
    }
}

impl From<CapturePoint> for String {
    fn from(p: CapturePoint) -> String {
        p.to_string()
    }
}

impl TryFrom<String> for CapturePoint {
    type Error = SchemaError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_layer_names_and_bare_indices() {
        assert_eq!(
            "layer_30".parse::<CapturePoint>().unwrap(),
            CapturePoint::LayerOutput(30)
        );
        assert_eq!(
            "2".parse::<CapturePoint>().unwrap(),
            CapturePoint::LayerOutput(2)
        );
        assert_eq!(
            "final_norm".parse::<CapturePoint>().unwrap(),
            CapturePoint::FinalNorm
        );
    }

    #[test]
    fn scale_column_is_the_point_column_with_scale_suffix() {
        assert_eq!(
            CapturePoint::LayerOutput(30).scale_column(),
            "layer_30_scale"
        );
        assert_eq!(CapturePoint::FinalNorm.scale_column(), "final_norm_scale");
    }

    #[test]
    fn rejects_negative_layer() {
        assert!("layer_-1".parse::<CapturePoint>().is_err());
    }
}
