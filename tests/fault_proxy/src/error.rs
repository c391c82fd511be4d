//! The proxy's one error type.

use thiserror::Error;

/// What starting the proxy or changing its rules can fail with.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A rule that cannot be used; names the rule and the field.
    #[error("rule {rule}: {what}")]
    Rule {
        /// The rule's name (`rule-<index>` when unnamed).
        rule: String,
        /// What is wrong and what was expected.
        what: String,
    },
    /// Rules that are not the expected JSON.
    #[error("rules are not valid JSON ({source}); expected {{\"seed\": N, \"rules\": [{{..., \"fault\": {{\"kind\": ...}}}}]}}")]
    RulesJson {
        /// The parser's message.
        #[source]
        source: serde_json::Error,
    },
    /// An upstream URL the proxy cannot forward to.
    #[error("upstream `{url}`: {what}; expected http://HOST:PORT (e.g. moto_server's endpoint)")]
    Upstream {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        what: String,
    },
    /// The listening socket or the proxy's runtime could not be set up.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}
