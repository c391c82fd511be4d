//! The dataset schema as an Arrow schema and back.
//!
//! Columns, in order: `sample_id`, `seq_len`, `num_loss_tokens`, `input_ids`, `loss_mask`,
//! then for each capture point `<point>` (LargeBinary, `plane_zstd` tensor), `<point>_scale`
//! (fp8 only), and the statistics `<point>_norm`, `<point>_max_abs`, `<point>_nan_count`,
//! `<point>_inf_count`.
use std::collections::HashMap;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};

use crate::{
    CapturePoint, DType, DatasetSchema, SchemaError, FORMAT_VERSION, OLDEST_FORMAT_VERSION,
};

/// Field-metadata key holding a tensor column's [`TensorFieldMeta`] as JSON.
pub const TENSOR_META_KEY: &str = "hslake.tensor";
/// Schema-metadata key holding the [`DatasetSchema`] as JSON.
pub const SCHEMA_META_KEY: &str = "hslake.schema";
/// Schema-metadata key holding the format version.
pub const FORMAT_META_KEY: &str = "hslake.format_version";

/// The encoding of every tensor value (see docs/FORMAT.md and `hslake_store::format::planes`).
pub const TENSOR_ENCODING: &str = "plane_zstd";

/// How to rebuild a tensor from one value of its column, stored in the field's metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorFieldMeta {
    /// Element type.
    pub dtype: DType,
    /// Shape with the variable token dimension as `null`: `[null, hidden]`.
    pub shape: Vec<Option<usize>>,
    /// Names of the dimensions: `["token", "hidden"]`.
    pub dim_names: Vec<String>,
    /// `layer_output` or `final_norm`.
    pub capture_point: String,
    /// The decoder layer (0-based), for `layer_output`.
    pub layer: Option<u32>,
    /// [`TENSOR_ENCODING`] (`plane_zstd`): rotated elements, byte and nibble planes, one zstd
    /// frame each (docs/FORMAT.md).
    pub encoding: String,
    /// Always `little`.
    pub byte_order: String,
    /// For fp8: the column with one f32 scale per token (itself `plane_zstd` f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_column: Option<String>,
}

/// Statistics stored per tensor column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatKind {
    /// Mean token L2 norm (Float32).
    Norm,
    /// Max |x| (Float32).
    MaxAbs,
    /// NaN count (UInt64).
    NanCount,
    /// Inf count (UInt64).
    InfCount,
}

impl StatKind {
    /// All statistics, in column order.
    pub const ALL: [StatKind; 4] = [
        StatKind::Norm,
        StatKind::MaxAbs,
        StatKind::NanCount,
        StatKind::InfCount,
    ];

    fn suffix(self) -> &'static str {
        match self {
            StatKind::Norm => "norm",
            StatKind::MaxAbs => "max_abs",
            StatKind::NanCount => "nan_count",
            StatKind::InfCount => "inf_count",
        }
    }

    fn data_type(self) -> DataType {
        match self {
            StatKind::Norm | StatKind::MaxAbs => DataType::Float32,
            StatKind::NanCount | StatKind::InfCount => DataType::UInt64,
        }
    }
}

/// Name of a statistics column: `layer_30_norm`.
pub fn stat_column(p: CapturePoint, kind: StatKind) -> String {
    format!("{}_{}", p.column(), kind.suffix())
}

/// Names of every column of a dataset, in order.
pub fn column_names(s: &DatasetSchema) -> Vec<String> {
    s.to_arrow()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect()
}

fn list_of(item: DataType) -> DataType {
    DataType::List(Arc::new(Field::new("item", item, false)))
}

impl DatasetSchema {
    /// Metadata of one tensor column.
    pub fn tensor_meta(&self, p: CapturePoint) -> TensorFieldMeta {
        TensorFieldMeta {
            dtype: self.dtype,
            shape: vec![None, Some(self.hidden_size)],
            dim_names: vec!["token".into(), "hidden".into()],
            capture_point: p.kind().into(),
            layer: p.layer(),
            encoding: TENSOR_ENCODING.into(),
            byte_order: "little".into(),
            scale_column: self.dtype.has_scales().then(|| p.scale_column()),
        }
    }

    /// The Arrow schema of a shard; field metadata describes every tensor.
    pub fn to_arrow(&self) -> Schema {
        let mut fields = vec![
            Field::new("sample_id", DataType::UInt64, false),
            Field::new("seq_len", DataType::UInt32, false),
            Field::new("num_loss_tokens", DataType::UInt32, false),
            Field::new("input_ids", list_of(DataType::Int32), false),
            Field::new("loss_mask", list_of(DataType::UInt8), false),
        ];
        for &p in &self.points {
            let meta = self.tensor_meta(p);
            let json = serde_json::to_string(&meta).expect("tensor metadata serialises");
            fields.push(
                Field::new(p.column(), DataType::LargeBinary, false)
                    .with_metadata(HashMap::from([(TENSOR_META_KEY.to_string(), json)])),
            );
            if let Some(sc) = meta.scale_column {
                let scale_meta = TensorFieldMeta {
                    dtype: DType::F32,
                    shape: vec![None],
                    dim_names: vec!["token".into()],
                    scale_column: None,
                    ..meta
                };
                let json = serde_json::to_string(&scale_meta).expect("scale metadata serialises");
                fields.push(
                    Field::new(sc, DataType::LargeBinary, false)
                        .with_metadata(HashMap::from([(TENSOR_META_KEY.to_string(), json)])),
                );
            }
            for k in StatKind::ALL {
                fields.push(Field::new(stat_column(p, k), k.data_type(), false));
            }
        }
        let schema_json = serde_json::to_string(self).expect("schema serialises");
        Schema::new(fields).with_metadata(HashMap::from([
            (SCHEMA_META_KEY.to_string(), schema_json),
            (FORMAT_META_KEY.to_string(), FORMAT_VERSION.to_string()),
        ]))
    }

    /// Rebuild the dataset schema from an Arrow schema written by [`DatasetSchema::to_arrow`],
    /// checking that every tensor field's metadata agrees with it.
    pub fn from_arrow(a: &Schema) -> Result<Self, SchemaError> {
        let err = |m: String| SchemaError::Arrow(m);
        if let Some(v) = a.metadata().get(FORMAT_META_KEY) {
            let v: u32 = v
                .parse()
                .map_err(|_| err(format!("format version {v:?} is not a number")))?;
            if v > FORMAT_VERSION {
                return Err(err(format!(
                    "written in format version {v}; this build reads up to {FORMAT_VERSION}: upgrade hslake"
                )));
            }
            if v < OLDEST_FORMAT_VERSION {
                return Err(err(format!(
                    "written in format version {v}, whose tensor encoding this build no longer reads (it reads {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION})"
                )));
            }
        }
        let json = a
            .metadata()
            .get(SCHEMA_META_KEY)
            .ok_or_else(|| err(format!("schema metadata has no {SCHEMA_META_KEY:?} key")))?;
        let s: DatasetSchema =
            serde_json::from_str(json).map_err(|e| err(format!("{SCHEMA_META_KEY}: {e}")))?;
        s.check()?;
        for &p in &s.points {
            let f = a
                .field_with_name(&p.column())
                .map_err(|_| err(format!("missing tensor column {:?}", p.column())))?;
            if f.data_type() != &DataType::LargeBinary {
                return Err(err(format!(
                    "column {:?} is {}, expected LargeBinary",
                    p.column(),
                    f.data_type()
                )));
            }
            let meta: TensorFieldMeta = f
                .metadata()
                .get(TENSOR_META_KEY)
                .ok_or_else(|| {
                    err(format!(
                        "column {:?} has no {TENSOR_META_KEY:?} metadata",
                        p.column()
                    ))
                })
                .and_then(|j| {
                    serde_json::from_str(j)
                        .map_err(|e| err(format!("column {:?} metadata: {e}", p.column())))
                })?;
            if meta != s.tensor_meta(p) {
                return Err(err(format!(
                    "column {:?}: field metadata {meta:?} disagrees with the dataset schema",
                    p.column()
                )));
            }
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(dtype: DType) -> DatasetSchema {
        DatasetSchema::new(
            "kimi",
            "DeepseekV3ForCausalLM",
            7168,
            61,
            163840,
            dtype,
            vec![
                CapturePoint::LayerOutput(2),
                CapturePoint::LayerOutput(30),
                CapturePoint::LayerOutput(58),
                CapturePoint::LayerOutput(60),
                CapturePoint::FinalNorm,
            ],
        )
        .unwrap()
    }

    #[test]
    fn round_trips_every_dtype_through_arrow() {
        for d in DType::ALL {
            let s = schema(d);
            assert_eq!(DatasetSchema::from_arrow(&s.to_arrow()).unwrap(), s);
        }
    }

    #[test]
    fn tensor_field_metadata_names_dtype_shape_and_layer() {
        let a = schema(DType::Bf16).to_arrow();
        let m = &a.field_with_name("layer_30").unwrap().metadata()[TENSOR_META_KEY];
        let v: serde_json::Value = serde_json::from_str(m).unwrap();
        assert_eq!(v["dtype"], "bf16");
        assert_eq!(v["shape"], serde_json::json!([null, 7168]));
        assert_eq!(v["layer"], 30);
        assert_eq!(v["capture_point"], "layer_output");
    }

    #[test]
    fn fp8_schema_has_scale_columns() {
        let names = column_names(&schema(DType::Fp8E4m3));
        assert!(names.contains(&"layer_30_scale".to_string()));
        assert!(!column_names(&schema(DType::Bf16)).contains(&"layer_30_scale".to_string()));
    }

    #[test]
    fn reads_format_versions_2_and_3_and_refuses_1() {
        let a = schema(DType::Bf16).to_arrow();
        assert_eq!(a.metadata()[FORMAT_META_KEY], "3");
        for (v, ok) in [("1", false), ("2", true), ("3", true)] {
            let mut md = a.metadata().clone();
            md.insert(FORMAT_META_KEY.into(), v.into());
            let got = DatasetSchema::from_arrow(&a.clone().with_metadata(md));
            assert_eq!(got.is_ok(), ok, "version {v}: {got:?}");
        }
    }

    #[test]
    fn rejects_newer_format_version() {
        let a = schema(DType::Bf16).to_arrow();
        let mut md = a.metadata().clone();
        md.insert(FORMAT_META_KEY.into(), "99".into());
        let err = DatasetSchema::from_arrow(&a.with_metadata(md))
            .unwrap_err()
            .to_string();
        assert!(err.contains("format version 99"), "{err}");
    }

    #[test]
    fn rejects_field_metadata_that_disagrees() {
        let a = schema(DType::Bf16).to_arrow();
        let fields: Vec<Field> = a
            .fields()
            .iter()
            .map(|f| {
                if f.name() == "layer_2" {
                    let mut md = f.metadata().clone();
                    md.insert(
                        TENSOR_META_KEY.into(),
                        md[TENSOR_META_KEY].replace("7168", "512"),
                    );
                    f.as_ref().clone().with_metadata(md)
                } else {
                    f.as_ref().clone()
                }
            })
            .collect();
        let b = Schema::new(fields).with_metadata(a.metadata().clone());
        assert!(DatasetSchema::from_arrow(&b)
            .unwrap_err()
            .to_string()
            .contains("\"layer_2\""));
    }
}
