//! Parameter names from the module tree: [`name_parameters`] gives each
//! parameter its fully qualified name, the one source of state-dict keys,
//! checkpoint entries, plans and errors; [`fqn_matches`] is the pattern syntax
//! of per-name rules.

use std::collections::HashMap;

use super::Module;
use crate::{Error, Param, Result};

/// `(name, param)` pairs with each parameter kept under its first name only.
pub(crate) fn dedup(all: Vec<(String, Param)>) -> Vec<(String, Param)> {
    let mut seen = std::collections::HashSet::new();
    all.into_iter().filter(|(_, p)| seen.insert(p.id())).collect()
}

/// Names every parameter below `root` by its fully qualified name
/// (`layers.0.attention.wq.weight`); a parameter reachable under several names
/// (tied weights) takes the first, depth first, as PyTorch's `named_parameters`
/// reports it, and is saved once under it. Returns the tied names as
/// `(alias, name)` pairs. Idempotent; materialising, tensor parallelism and the
/// reference models run it on their root, and a model built by hand runs it once
/// on its root before anything else reads names.
///
/// # Errors
/// Two different parameters under one name (a module listing two children or
/// parameters under the same name): the error names it.
pub fn name_parameters(root: &dyn Module) -> Result<Vec<(String, String)>> {
    let all = root.named_parameters_with_duplicates();
    let mut by_name: HashMap<&str, u64> = HashMap::new();
    let mut first: HashMap<u64, &str> = HashMap::new();
    let mut aliases = Vec::new();
    for (name, p) in &all {
        if let Some(&other) = by_name.get(name.as_str())
            && other != p.id()
        {
            return Err(Error::Config {
                op: "name_parameters",
                detail: format!(
                    "two different parameters are both named `{name}`; a module lists two children or two \
                     parameters under one name (names must be unique among siblings)"
                ),
            });
        }
        by_name.insert(name, p.id());
        match first.get(&p.id()) {
            Some(&canonical) if canonical != name => aliases.push((name.clone(), canonical.to_string())),
            Some(_) => {}
            None => {
                first.insert(p.id(), name);
            }
        }
    }
    for (name, p) in &all {
        if first.get(&p.id()) == Some(&name.as_str()) {
            p.set_name(name);
        }
    }
    Ok(aliases)
}

/// Whether `fqn` matches `pattern`, where `*` stands for any run of characters
/// (dots included): `layers.*.attention.wq.weight`, `*.bias`, `output.weight`.
pub fn fqn_matches(pattern: &str, fqn: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == fqn;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !fqn.starts_with(first) || fqn.len() < first.len() + last.len() || !fqn.ends_with(last) {
        return false;
    }
    let mut rest = &fqn[first.len()..fqn.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use tessera_dtensor::DType;
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;
    use crate::nn::{Embedding, Linear};
    use crate::{Result, Var};

    /// An embedding and a head sharing its table (weight tying).
    struct Tied {
        embed: Embedding,
        head: Linear,
    }

    impl Module for Tied {
        fn named_children(&self) -> Vec<(String, &dyn Module)> {
            vec![("embed".into(), &self.embed), ("head".into(), &self.head)]
        }
        fn forward(&self, x: &Var) -> Result<Var> {
            self.head.call(&self.embed.call(x)?)
        }
    }

    /// Two children under one name.
    struct Clash {
        a: Linear,
        b: Linear,
    }

    impl Module for Clash {
        fn named_children(&self) -> Vec<(String, &dyn Module)> {
            vec![("fc".into(), &self.a), ("fc".into(), &self.b)]
        }
        fn forward(&self, x: &Var) -> Result<Var> {
            Ok(x.clone())
        }
    }

    #[test]
    fn names_come_from_the_tree_and_tied_weights_keep_their_first_name() {
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let embed = Embedding::new(10, 4, &mesh, DType::F32)?;
            let mut head = Linear::new(4, 10, false, &mesh, DType::F32)?;
            head.weight = embed.weight.clone();
            let model = Tied { embed, head };
            assert!(!model.embed.weight.is_named());
            let aliases = name_parameters(&model)?;
            assert_eq!(aliases, [("head.weight".to_string(), "embed.weight".to_string())]);
            assert_eq!(model.head.weight.name(), "embed.weight");
            // Listed once, under its first name.
            let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
            assert_eq!(names, ["embed.weight"]);
            assert_eq!(model.named_parameters_with_duplicates().len(), 2);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn two_parameters_under_one_name_are_an_error() {
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let clash = Clash {
                a: Linear::new(2, 2, false, &mesh, DType::F32)?,
                b: Linear::new(2, 2, false, &mesh, DType::F32)?,
            };
            let e = name_parameters(&clash).unwrap_err().to_string();
            assert!(e.contains("`fc.weight`") && e.contains("unique"), "{e}");
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn patterns_match_runs_of_characters() {
        assert!(fqn_matches(
            "layers.*.attention.wq.weight",
            "layers.10.attention.wq.weight"
        ));
        assert!(fqn_matches("*.bias", "layers.0.feed_forward.w1.bias"));
        assert!(!fqn_matches("*.bias", "layers.0.feed_forward.w1.weight"));
        assert!(fqn_matches("output.weight", "output.weight"));
        assert!(!fqn_matches("output", "output.weight"));
        assert!(fqn_matches("*", "anything"));
        assert!(fqn_matches("a*b*c", "a-b-c"));
        assert!(!fqn_matches("a*b*c", "a-c"));
        assert!(!fqn_matches("ab*ba", "aba"));
    }
}
