//! The static check of a chat template for skeletons (the first check in the parent module's
//! doc): every read of a message's text by a constant name goes straight to the output, and the
//! skeleton's copy of the template reads the sentinel there when the object is a skeleton
//! message.
use std::ops::Range;

use minijinja::machinery::ast::{self, BinOpKind, CallArg, Expr, Stmt};
use minijinja::syntax::SyntaxConfig;

use super::{SENTINEL, TEXT_KEYS};

/// The skeleton's copy of a template source, or why the template does not qualify.
pub fn analyze(source: &str, syntax: SyntaxConfig) -> Result<String, String> {
    if source.contains(SENTINEL) {
        return Err("the template contains hslake's sentinel character U+10FFFB".into());
    }
    let tree = minijinja::machinery::parse(source, "chat_template", syntax)
        .map_err(|e| format!("cannot parse the template: {e}"))?;
    let mut walk = Walk {
        src: source,
        edits: vec![],
        refused: None,
    };
    walk.stmt(&tree, false);
    if let Some(reason) = walk.refused {
        return Err(reason);
    }
    if walk.edits.is_empty() {
        return Err("the template never prints a message's text".into());
    }
    walk.edits.sort_by_key(|(r, _)| r.start);
    let mut out = String::with_capacity(source.len() + 32 * walk.edits.len());
    let mut at = 0;
    for (range, text) in &walk.edits {
        out.push_str(&source[at..range.start]);
        out.push_str(text);
        at = range.end;
    }
    out.push_str(&source[at..]);
    Ok(out)
}

// The template's reads of message texts: where each printed one sits in the source, or the first
// that is used otherwise.
struct Walk<'s> {
    src: &'s str,
    edits: Vec<(Range<usize>, String)>,
    refused: Option<String>,
}

// A read of a text field by a constant name: the field and the object it is read from.
fn text_read<'e, 's>(e: &'e Expr<'s>) -> Option<(&'static str, &'e Expr<'s>)> {
    let key = |name: &str| TEXT_KEYS.iter().find(|(k, _)| *k == name).map(|&(k, _)| k);
    match e {
        Expr::GetAttr(g) => Some((key(g.name)?, &g.expr)),
        Expr::GetItem(g) => match &g.subscript_expr {
            Expr::Const(c) => Some((key(c.value.as_str()?)?, &g.expr)),
            _ => None,
        },
        _ => None,
    }
}

// Whether evaluating an expression twice gives the same value: variables, constants and
// attributes or items of those (no calls, filters or operators).
fn plain(e: &Expr<'_>) -> bool {
    match e {
        Expr::Var(_) | Expr::Const(_) => true,
        Expr::GetAttr(g) => plain(&g.expr),
        Expr::GetItem(g) => plain(&g.expr) && plain(&g.subscript_expr),
        _ => false,
    }
}

fn source_of<'s>(src: &'s str, e: &Expr<'_>) -> &'s str {
    let span = e.span();
    &src[span.start_offset as usize..span.end_offset as usize]
}

impl Walk<'_> {
    fn refuse(&mut self, line: u16, what: String) {
        if self.refused.is_none() {
            self.refused = Some(format!("line {line}: {what}"));
        }
    }

    fn stmts(&mut self, body: &[Stmt<'_>], captured: bool) {
        for s in body {
            self.stmt(s, captured);
        }
    }

    // `captured`: output of this statement does not go straight to the rendering (a `set`
    // block, a macro, a filter or autoescape block).
    fn stmt(&mut self, s: &Stmt<'_>, captured: bool) {
        match s {
            Stmt::Template(t) => self.stmts(&t.children, captured),
            Stmt::EmitExpr(e) if captured => self.expr(&e.expr),
            Stmt::EmitExpr(e) => self.printed(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
            Stmt::ForLoop(f) => {
                self.expr(&f.target);
                self.expr(&f.iter);
                if let Some(x) = &f.filter_expr {
                    self.expr(x);
                }
                self.stmts(&f.body, captured);
                self.stmts(&f.else_body, captured);
            }
            Stmt::IfCond(c) => {
                self.expr(&c.expr);
                self.stmts(&c.true_body, captured);
                self.stmts(&c.false_body, captured);
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    self.expr(target);
                    self.expr(value);
                }
                self.stmts(&w.body, captured);
            }
            Stmt::Set(x) => {
                self.expr(&x.target);
                self.expr(&x.expr);
            }
            Stmt::SetBlock(x) => {
                self.expr(&x.target);
                if let Some(f) = &x.filter {
                    self.expr(f);
                }
                self.stmts(&x.body, true);
            }
            Stmt::AutoEscape(x) => {
                self.expr(&x.enabled);
                self.stmts(&x.body, true);
            }
            Stmt::FilterBlock(x) => {
                self.expr(&x.filter);
                self.stmts(&x.body, true);
            }
            Stmt::Macro(m) => self.macro_decl(m),
            Stmt::CallBlock(c) => {
                self.call(&c.call);
                self.macro_decl(&c.macro_decl);
            }
            Stmt::Do(d) => self.call(&d.call),
            Stmt::Block(b) => self.refuse(b.span().start_line, "uses template blocks".into()),
            Stmt::Import(x) => self.refuse(x.span().start_line, "imports a template".into()),
            Stmt::FromImport(x) => self.refuse(x.span().start_line, "imports a template".into()),
            Stmt::Extends(x) => self.refuse(x.span().start_line, "extends a template".into()),
            Stmt::Include(x) => self.refuse(x.span().start_line, "includes a template".into()),
        }
    }

    fn macro_decl(&mut self, m: &ast::Macro<'_>) {
        for e in m.args.iter().chain(&m.defaults) {
            self.expr(e);
        }
        self.stmts(&m.body, true);
    }

    fn call(&mut self, c: &ast::Call<'_>) {
        self.expr(&c.expr);
        self.args(&c.args);
    }

    fn args(&mut self, args: &[CallArg<'_>]) {
        for a in args {
            self.expr(crate::syntax::arg_expr(a));
        }
    }

    // Renames a text read in the skeleton's copy: a skeleton message answers with its sentinel,
    // any other object (a namespace, a literal map: data of the template, not of a message)
    // with its own field as before.
    fn rename(&mut self, read: &Expr<'_>, key: &str, object: &Expr<'_>) {
        if !plain(object) {
            self.refuse(
                read.span().start_line,
                format!("a message's {key} is read from a computed object"),
            );
            return;
        }
        self.expr(object);
        let x = source_of(self.src, object);
        let renamed = TEXT_KEYS
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(key, |&(_, r)| r);
        let span = read.span();
        self.edits.push((
            span.start_offset as usize..span.end_offset as usize,
            format!(
                "({x}.{renamed} if {x} is hslake_skeleton_message else {})",
                source_of(self.src, read)
            ),
        ));
    }

    // An expression whose value is printed as it is.
    fn printed(&mut self, e: &Expr<'_>) {
        if let Some((key, object)) = text_read(e) {
            self.rename(e, key, object);
            return;
        }
        match e {
            Expr::BinOp(b) if matches!(b.op, BinOpKind::Add | BinOpKind::Concat) => {
                self.printed(&b.left);
                self.printed(&b.right);
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.printed(&i.true_expr);
                if let Some(f) = &i.false_expr {
                    self.printed(f);
                }
            }
            _ => self.expr(e),
        }
    }

    // An expression whose value may steer the template or be changed before it is printed.
    fn expr(&mut self, e: &Expr<'_>) {
        // Whether a text is there: the same for every text, and part of a skeleton's key.
        if let Expr::Test(t) = e {
            if t.args.is_empty() && ["defined", "undefined", "none", "string"].contains(&t.name) {
                if let Some((key, object)) = text_read(&t.expr) {
                    self.rename(&t.expr, key, object);
                    return;
                }
            }
        }
        if let Some((key, _)) = text_read(e) {
            self.refuse(
                e.span().start_line,
                format!("a message's {key} is used other than printed as it is"),
            );
            return;
        }
        match e {
            Expr::Const(c) if c.value.as_str().is_some_and(|t| t.contains(SENTINEL)) => self
                .refuse(
                    c.span().start_line,
                    "a string holds hslake's sentinel character U+10FFFB".into(),
                ),
            _ => crate::syntax::each_child(e, &mut |c| self.expr(c)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syntax() -> SyntaxConfig {
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .unwrap()
    }

    fn refusal(src: &str) -> String {
        analyze(src, syntax()).unwrap_err()
    }

    #[test]
    fn renames_printed_reads_of_message_texts() {
        let src = "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{{ m . content ~ (m.thinking if m.thinking is defined else '') }}{% endfor %}";
        assert_eq!(
            analyze(src, syntax()).unwrap(),
            "{% for m in messages %}{{ '<' + m['role'] + '>' + (m.hslake_skeleton_content if m is hslake_skeleton_message else m['content']) }}{{ (m.hslake_skeleton_content if m is hslake_skeleton_message else m . content) ~ ((m.hslake_skeleton_thinking if m is hslake_skeleton_message else m.thinking) if (m.hslake_skeleton_thinking if m is hslake_skeleton_message else m.thinking) is defined else '') }}{% endfor %}"
        );
    }

    #[test]
    fn refuses_templates_that_inspect_or_transform_texts() {
        for (src, what) in [
            (
                "{{ messages[0]['content'] | trim }}",
                "line 1: a message's content is used other than printed",
            ),
            (
                "{% if m.content %}x{% endif %}",
                "content is used other than printed",
            ),
            (
                "{% set c = m.content %}{{ c }}",
                "content is used other than printed",
            ),
            (
                "{{ m.content.split('</think>')[-1] }}",
                "content is used other than printed",
            ),
            (
                "{% filter upper %}{{ m.content }}{% endfilter %}",
                "content is used other than printed",
            ),
            (
                "{% macro f(m) %}{{ m.content }}{% endmacro %}{{ f(x) }}",
                "content is used other than printed",
            ),
            (
                "{{ 'a' if m.reasoning_content else m.content }}",
                "reasoning_content is used other than printed",
            ),
            (
                "{{ m.content if m.content is startingwith('<') }}",
                "content is used other than printed",
            ),
            ("{% include 'x' %}", "includes a template"),
            (
                "{{ (messages | last).content }}",
                "content is read from a computed object",
            ),
            ("{{ m.role }}", "never prints a message's text"),
        ] {
            let e = refusal(src);
            assert!(e.contains(what), "{src}: {e}");
        }
    }
}
