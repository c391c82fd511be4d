//! The macro that declares an options struct once, as DataFusion's `config_namespace!` does:
//! each option's doc, type and default stand together, and the struct, its `Default`, its
//! serde form (JSON keys = field names, a key left out takes the default, an unknown key is
//! refused) and the listing that Python shows ([`OptionDoc`]) all come from that one place.

/// One option as users name it, with its documentation (what `hslake.loader_options()` lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionDoc {
    /// The field name, which is also the JSON key and the Python keyword.
    pub name: &'static str,
    /// The doc comment, its lines joined by `\n`.
    pub doc: &'static str,
}

impl OptionDoc {
    /// The doc comment as one line of prose.
    pub fn text(&self) -> String {
        self.doc.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

/// Declare an options struct: `pub name: Type = default,` per field, each after its doc comment
/// and, where the JSON form needs it, `#[serde(...)]` attributes (after the doc comment).
/// Generates the struct (serde, `Debug`, `Clone`, `PartialEq`), its `Default` from the declared
/// defaults (each field's rustdoc names its default), and `OPTIONS`, the [`OptionDoc`] of every
/// field in declaration order.
macro_rules! declare_options {
    (
        $(#[doc = $struct_doc:literal])*
        pub struct $name:ident {
            $(
                $(#[doc = $doc:literal])+
                $(#[serde($($serde:tt)*)])*
                pub $field:ident: $ty:ty = $default:expr,
            )*
        }
    ) => {
        $(#[doc = $struct_doc])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            $(
                $(#[doc = $doc])+
                #[doc = ""]
                #[doc = concat!("Default: `", stringify!($default), "`.")]
                $(#[serde($($serde)*)])*
                pub $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                $name {
                    $($field: $default,)*
                }
            }
        }

        impl $name {
            /// Every option, in declaration order, with its doc comment.
            pub const OPTIONS: &'static [$crate::declare::OptionDoc] = &[
                $($crate::declare::OptionDoc {
                    name: stringify!($field),
                    doc: concat!($($doc, "\n"),+),
                },)*
            ];
        }
    };
}

pub(crate) use declare_options;

#[cfg(test)]
mod tests {
    declare_options! {
        /// Options of a test.
        pub struct Demo {
            /// How many.
            /// Two lines of doc.
            pub count: usize = 3,
            /// Which name.
            #[serde(rename = "label")]
            pub name: Option<String> = None,
        }
    }

    #[test]
    fn defaults_docs_and_serde_come_from_the_one_declaration() {
        assert_eq!(
            Demo::default(),
            Demo {
                count: 3,
                name: None
            }
        );
        let names: Vec<&str> = Demo::OPTIONS.iter().map(|o| o.name).collect();
        assert_eq!(names, ["count", "name"]);
        assert_eq!(Demo::OPTIONS[0].text(), "How many. Two lines of doc.");
        // Keys left out take the declared defaults; the serde attribute applies.
        let d: Demo = serde_json::from_str(r#"{"label": "x"}"#).unwrap();
        assert_eq!((d.count, d.name.as_deref()), (3, Some("x")));
        let err = serde_json::from_str::<Demo>(r#"{"cont": 1}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `cont`"), "{err}");
    }
}
