//! The `hslake.tensor` metadata of a tensor call's arguments, carried by the call itself.
//!
//! A plan sent to a worker ([`crate::distributed`]) travels as DataFusion's protobuf, which
//! keeps a column's metadata but rebuilds a function's result field from its type alone
//! (datafusion-proto 55): `dequantize(...)`'s result, and a column the optimizer computes once
//! for several calls (`__common_expr_1`), reach the worker without the metadata that says what
//! their values are. So [`super::TensorArgRewrite`] ends every call it completes with a string
//! literal of what each argument's field says while the plan still knows, and a function given
//! a field without metadata takes it from there. A literal travels with the call wherever the
//! call goes, through every optimizer rule and codec.
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::{DFSchema, ScalarValue};
use datafusion::logical_expr::{Expr, ExprSchemable};
use hslake_schemas::{TensorFieldMeta, TENSOR_META_KEY};

/// The tensor metadata of each of a call's own arguments, `None` where a field has none.
#[derive(Debug, PartialEq)]
pub(super) struct Pins(Vec<Option<TensorFieldMeta>>);

impl Pins {
    /// What the fields of `args` say in `schema`.
    pub(super) fn of_args(args: &[Expr], schema: &DFSchema) -> Pins {
        Pins(
            args.iter()
                .map(|a| {
                    let (_, field) = a.to_field(schema).ok()?;
                    serde_json::from_str(field.metadata().get(TENSOR_META_KEY)?).ok()
                })
                .collect(),
        )
    }

    /// The literal argument that carries them.
    pub(super) fn literal(&self) -> Expr {
        let json = serde_json::to_string(&self.0).expect("tensor metadata serializes");
        Expr::Literal(ScalarValue::Utf8(Some(json)), None)
    }

    /// The pins a call of `function` carries as its last argument `value`.
    pub(super) fn read(function: &str, value: Option<&ScalarValue>) -> Result<Pins, String> {
        let bad = |what: String| {
            format!(
                "{function}: its last argument is {what}; expected the arguments' tensor \
                 metadata that hslake's rewrite adds (is every worker the same version as the \
                 coordinator?)"
            )
        };
        match value {
            Some(ScalarValue::Utf8(Some(json))) => serde_json::from_str(json)
                .map(Pins)
                .map_err(|e| bad(format!("unreadable ({e})"))),
            Some(other) => Err(bad(format!("{other:?}"))),
            None => Err(bad("not a literal".into())),
        }
    }

    /// `fields` with each binary field that lacks tensor metadata given its pin.
    pub(super) fn fill(&self, fields: &[FieldRef]) -> Vec<FieldRef> {
        fields
            .iter()
            .enumerate()
            .map(|(i, f)| match self.0.get(i) {
                Some(Some(meta))
                    if f.data_type() == &DataType::LargeBinary
                        && !f.metadata().contains_key(TENSOR_META_KEY) =>
                {
                    let mut metadata = f.metadata().clone();
                    let json = serde_json::to_string(meta).expect("tensor metadata serializes");
                    metadata.insert(TENSOR_META_KEY.to_string(), json);
                    Arc::new(f.as_ref().clone().with_metadata(metadata))
                }
                _ => f.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::Field;
    use hslake_schemas::DType;

    fn meta(dtype: DType) -> TensorFieldMeta {
        TensorFieldMeta {
            dtype,
            shape: vec![None, Some(4)],
            dim_names: vec!["token".into(), "hidden".into()],
            capture_point: "layer_output".into(),
            layer: Some(2),
            encoding: hslake_schemas::TENSOR_ENCODING.into(),
            byte_order: "little".into(),
            scale_column: None,
        }
    }

    fn tensor_field(name: &str, meta: Option<&TensorFieldMeta>) -> FieldRef {
        let f = Field::new(name, DataType::LargeBinary, true);
        Arc::new(match meta {
            Some(m) => f.with_metadata(
                [(TENSOR_META_KEY.into(), serde_json::to_string(m).unwrap())].into(),
            ),
            None => f,
        })
    }

    #[test]
    fn fills_only_fields_that_lost_their_metadata() {
        let pins = Pins(vec![Some(meta(DType::F32)), Some(meta(DType::F32)), None]);
        let Expr::Literal(value, _) = pins.literal() else {
            panic!("not a literal")
        };
        let pins = Pins::read("tensor_norm", Some(&value)).unwrap();
        let kept = meta(DType::Bf16);
        let fields = [
            tensor_field("__common_expr_1", None),
            tensor_field("layer_2", Some(&kept)),
            Arc::new(Field::new("seq_len", DataType::UInt64, true)),
        ];
        let filled = pins.fill(&fields);
        let meta_of = |f: &FieldRef| -> Option<TensorFieldMeta> {
            serde_json::from_str(f.metadata().get(TENSOR_META_KEY)?).ok()
        };
        assert_eq!(meta_of(&filled[0]), Some(meta(DType::F32)));
        assert_eq!(
            meta_of(&filled[1]),
            Some(kept),
            "a field's own metadata wins"
        );
        assert_eq!(filled[2], fields[2]);
    }

    #[test]
    fn refuses_a_last_argument_that_is_not_pins() {
        let e = Pins::read("tensor_norm", Some(&ScalarValue::UInt64(Some(3)))).unwrap_err();
        assert!(
            e.starts_with("tensor_norm: its last argument is UInt64(3)"),
            "{e}"
        );
        let e = Pins::read("tensor_norm", Some(&ScalarValue::Utf8(Some("[".into())))).unwrap_err();
        assert!(e.contains("unreadable"), "{e}");
        assert!(Pins::read("tensor_norm", None).is_err());
    }
}
