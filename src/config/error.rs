//! Configuration errors: each names the key, what is wrong, and the fix.

use std::fmt;
use std::path::PathBuf;

/// One thing wrong with a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The YAML key at fault (or the first of the keys that conflict).
    pub key: String,
    /// What is wrong.
    pub problem: String,
    /// How to fix it.
    pub fix: String,
}

impl ConfigProblem {
    pub(crate) fn new(key: &str, problem: impl Into<String>, fix: impl Into<String>) -> Self {
        ConfigProblem {
            key: key.to_string(),
            problem: problem.into(),
            fix: fix.into(),
        }
    }
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (fix: {})", self.key, self.problem, self.fix)
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid YAML.
    #[error("{origin}: YAML syntax error at line {line}, column {column}: {message}")]
    Syntax {
        /// The file (or `<string>`).
        origin: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// The YAML parsed, but keys are missing, mistyped or contradict each other.
    #[error("{origin}: invalid configuration:\n{}", list(.problems))]
    Invalid {
        /// The file (or `<string>`).
        origin: String,
        /// Every problem found, not just the first.
        problems: Vec<ConfigProblem>,
    },
}

fn list(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl ConfigError {
    /// The problems of an `Invalid` error (empty for the other kinds).
    pub fn problems(&self) -> &[ConfigProblem] {
        match self {
            ConfigError::Invalid { problems, .. } => problems,
            _ => &[],
        }
    }
}
