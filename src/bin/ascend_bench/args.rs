//! A small `--flag value` parser with errors that name the flag.

use std::collections::HashMap;
use std::str::FromStr;

/// Parsed `--flag value` pairs; every flag must be read or it is reported unknown.
pub struct Args {
    values: HashMap<String, String>,
    used: std::cell::RefCell<Vec<String>>,
    command: String,
}

impl Args {
    /// Parses `args` (after the subcommand) for `command`.
    pub fn parse(command: &str, args: &[String]) -> Result<Args, String> {
        let mut values = HashMap::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let Some(name) = a.strip_prefix("--") else {
                return Err(format!(
                    "{command}: unexpected argument {a:?} (flags look like --name value)"
                ));
            };
            let (name, value) = match name.split_once('=') {
                Some((n, v)) => (n.to_string(), v.to_string()),
                None => {
                    let v = it
                        .next()
                        .ok_or_else(|| format!("{command}: --{name} needs a value"))?;
                    (name.to_string(), v.clone())
                }
            };
            if values.insert(name.clone(), value).is_some() {
                return Err(format!("{command}: --{name} given twice"));
            }
        }
        Ok(Args {
            values,
            used: Default::default(),
            command: command.to_string(),
        })
    }

    /// The value of `--name`, parsed, or `default`.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        Ok(self.opt(name)?.unwrap_or(default))
    }

    /// The value of `--name`, parsed, if given.
    pub fn opt<T: FromStr>(&self, name: &str) -> Result<Option<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        self.used.borrow_mut().push(name.to_string());
        match self.values.get(name) {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|e| format!("{}: --{name} {v:?}: {e}", self.command)),
        }
    }

    /// Fails if any flag was given that no `get`/`opt` asked for.
    pub fn finish(&self) -> Result<(), String> {
        let used = self.used.borrow();
        let mut unknown: Vec<&String> = self.values.keys().filter(|k| !used.contains(k)).collect();
        unknown.sort();
        match unknown.first() {
            None => Ok(()),
            Some(k) => Err(format!("{}: unknown flag --{k}", self.command)),
        }
    }
}
