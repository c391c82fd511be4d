//! The guarded copy of a template's source: every expression that can build a container wrapped
//! in [`SETTLE`], every value assigned to a namespace's attribute in [`ASSIGN`] (the parent
//! module says why). Edits are insertions at the expressions' source ranges, so the copy keeps
//! the template's text, lines and whitespace control.
use std::ops::Range;

use minijinja::machinery::ast::{self, BinOpKind, CallArg, Expr, Stmt};
use minijinja::machinery::{parse, tokenize, Token};
use minijinja::syntax::SyntaxConfig;

use super::{ASSIGN, RESERVED, SETTLE};

/// Filters whose result is a string.
const STRING_FILTERS: [&str; 15] = [
    "capitalize",
    "e",
    "escape",
    "format",
    "indent",
    "join",
    "lower",
    "pprint",
    "replace",
    "safe",
    "string",
    "title",
    "tojson",
    "trim",
    "upper",
];

/// Filters whose result is a number, a boolean or a value they were given (an item, the
/// default, an attribute).
const KEPT_FILTERS: [&str; 14] = [
    "abs", "attr", "bool", "count", "d", "default", "first", "float", "int", "last", "length",
    "max", "min", "round",
];

/// Methods (Python's, as minijinja-contrib gives strings and maps) that return a string, a
/// number, a boolean or a value the object holds.
const PLAIN_METHODS: [&str; 25] = [
    "capitalize",
    "count",
    "endswith",
    "find",
    "format",
    "get",
    "isalnum",
    "isalpha",
    "isascii",
    "isdigit",
    "islower",
    "isnumeric",
    "isspace",
    "isupper",
    "join",
    "lower",
    "lstrip",
    "replace",
    "rfind",
    "rstrip",
    "startswith",
    "strip",
    "title",
    "upper",
    "cycle",
];

/// Functions whose result needs no settling: the two transformers adds (a string, or never
/// returning), `range` (at most 100,000 integers, lazily), and the loop and caller calls (text).
const PLAIN_FUNCTIONS: [&str; 5] = ["raise_exception", "strftime_now", "range", "loop", "caller"];

/// The guarded copy of `source`, or why there is none (a name it may not use). `source` must
/// parse (the caller compiled it first, so a syntax error is reported as such).
pub fn guarded_copy(source: &str, syntax: SyntaxConfig) -> Result<String, String> {
    if source.contains(RESERVED) {
        return Err(format!(
            "the template uses the name prefix {RESERVED}, which hslake reserves for its guard"
        ));
    }
    let tree = parse(source, "chat_template", syntax.clone())
        .map_err(|e| format!("cannot parse the template: {e}"))?;
    let mut brackets = vec![];
    for token in tokenize(source, false, syntax) {
        let (token, span) = token.map_err(|e| format!("cannot tokenize the template: {e}"))?;
        let depth = match token {
            Token::ParenOpen | Token::BracketOpen | Token::BraceOpen => 1,
            Token::ParenClose | Token::BracketClose | Token::BraceClose => -1,
            _ => continue,
        };
        brackets.push((span.start_offset as usize, depth));
    }
    let mut walk = Walk {
        src: source,
        brackets,
        edits: vec![],
    };
    walk.stmt(&tree);
    // At one offset: ends before starts; starts outermost first, ends innermost first.
    walk.edits.sort_by_key(|e| {
        (
            e.at,
            e.opens,
            if e.opens {
                e.order
            } else {
                usize::MAX - e.order
            },
        )
    });
    let mut out = String::with_capacity(source.len() + 24 * walk.edits.len());
    let mut at = 0;
    for e in &walk.edits {
        out.push_str(&source[at..e.at]);
        out.push_str(&e.text);
        at = e.at;
    }
    out.push_str(&source[at..]);
    Ok(out)
}

// One insertion into the source.
struct Edit {
    at: usize,
    opens: bool,
    // Walk order of the expression it belongs to (outer before inner).
    order: usize,
    text: String,
}

struct Walk<'s> {
    src: &'s str,
    // Offsets of the bracket tokens, +1 opening, -1 closing, in source order.
    brackets: Vec<(usize, i32)>,
    edits: Vec<Edit>,
}

impl Walk<'_> {
    fn stmts(&mut self, body: &[Stmt<'_>]) {
        body.iter().for_each(|s| self.stmt(s));
    }

    fn stmt(&mut self, s: &Stmt<'_>) {
        match s {
            Stmt::Template(t) => self.stmts(&t.children),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
            Stmt::ForLoop(f) => {
                self.expr(&f.iter);
                if let Some(x) = &f.filter_expr {
                    self.expr(x);
                }
                self.stmts(&f.body);
                self.stmts(&f.else_body);
            }
            Stmt::IfCond(c) => {
                self.expr(&c.expr);
                self.stmts(&c.true_body);
                self.stmts(&c.false_body);
            }
            Stmt::WithBlock(w) => {
                for (_, value) in &w.assignments {
                    self.expr(value);
                }
                self.stmts(&w.body);
            }
            Stmt::Set(x) => {
                // `{% set ns.attr = value %}`: the one way a template changes a value, so the
                // one way a namespace could come to hold itself.
                if let Expr::GetAttr(target) = &x.target {
                    let ns = self.range(&target.expr);
                    let value = self.range(&x.expr);
                    let open = format!("{ASSIGN}({}, (", &self.src[ns]);
                    self.wrap(value, open);
                }
                self.expr(&x.expr);
            }
            Stmt::SetBlock(x) => {
                if let Some(f) = &x.filter {
                    self.filter_args(f);
                }
                self.stmts(&x.body);
            }
            Stmt::AutoEscape(x) => {
                self.expr(&x.enabled);
                self.stmts(&x.body);
            }
            Stmt::FilterBlock(x) => {
                self.filter_args(&x.filter);
                self.stmts(&x.body);
            }
            Stmt::Macro(m) => self.macro_decl(m),
            Stmt::CallBlock(c) => {
                self.expr(&c.call.expr);
                self.args(&c.call.args);
                self.macro_decl(&c.macro_decl);
            }
            Stmt::Do(d) => {
                self.expr(&d.call.expr);
                self.args(&d.call.args);
            }
            Stmt::Block(b) => self.stmts(&b.body),
            Stmt::Import(_) | Stmt::FromImport(_) | Stmt::Extends(_) | Stmt::Include(_) => {}
        }
    }

    fn macro_decl(&mut self, m: &ast::Macro<'_>) {
        m.defaults.iter().for_each(|e| self.expr(e));
        self.stmts(&m.body);
    }

    // The arguments of a filter applied to a block (`{% filter f(x) %}`): its input is the
    // block's text.
    fn filter_args(&mut self, f: &Expr<'_>) {
        match f {
            Expr::Filter(f) => self.args(&f.args),
            other => self.expr(other),
        }
    }

    fn args(&mut self, args: &[CallArg<'_>]) {
        for a in args {
            self.expr(crate::syntax::arg_expr(a));
        }
    }

    fn expr(&mut self, e: &Expr<'_>) {
        if builds_container(e) {
            let range = self.range(e);
            self.wrap(range, format!("{SETTLE}(("));
        }
        crate::syntax::each_child(e, &mut |c| self.expr(c));
    }

    // Encloses `range` in `open` … `))`.
    fn wrap(&mut self, range: Range<usize>, open: String) {
        let order = self.edits.len();
        self.edits.push(Edit {
            at: range.start,
            opens: true,
            order,
            text: open,
        });
        self.edits.push(Edit {
            at: range.end,
            opens: false,
            order,
            text: "))".into(),
        });
    }

    // The source range of an expression. minijinja's spans of some nodes leave out a part of
    // them (a filter's span is its name and arguments, a method call's starts at the dot), so
    // the range is the union with every node below it, widened to the enclosing brackets
    // until the brackets inside it match.
    fn range(&self, e: &Expr<'_>) -> Range<usize> {
        let span = e.span();
        let mut r = span.start_offset as usize..span.end_offset as usize;
        union(e, &mut r);
        loop {
            let inside = self
                .brackets
                .iter()
                .filter(|(at, _)| r.contains(at))
                .map(|(_, d)| *d);
            let (mut depth, mut lowest) = (0, 0);
            for d in inside {
                depth += d;
                lowest = lowest.min(depth);
            }
            if lowest < 0 {
                // An opening bracket before the range closes inside it.
                match self
                    .brackets
                    .iter()
                    .rev()
                    .find(|(at, d)| *at < r.start && *d > 0)
                {
                    Some((at, _)) => r.start = *at,
                    None => return r,
                }
            } else if depth > 0 {
                match self.brackets.iter().find(|(at, d)| *at >= r.end && *d < 0) {
                    Some((at, _)) => r.end = at + 1,
                    None => return r,
                }
            } else {
                return r;
            }
        }
    }
}

// Widens `r` to the spans of `e` and every node below it.
fn union(e: &Expr<'_>, r: &mut Range<usize>) {
    let s = e.span();
    r.start = r.start.min(s.start_offset as usize);
    r.end = r.end.max(s.end_offset as usize);
    crate::syntax::each_child(e, &mut |c| union(c, r));
}

// Whether an expression's value may be a container the engine builds lazily or that holds
// the same value more than once: its result is settled.
fn builds_container(e: &Expr<'_>) -> bool {
    match e {
        Expr::BinOp(b) => match b.op {
            // A string or a number on either side: a string, a number, or an error.
            BinOpKind::Add => ![&b.left, &b.right]
                .into_iter()
                .any(|x| is_string(x) || matches!(x, Expr::Const(c) if c.value.is_number())),
            // A string repeated: the engine checks its size before building it.
            BinOpKind::Mul => !(is_str_const(&b.left) || is_str_const(&b.right)),
            _ => false,
        },
        Expr::List(_) | Expr::Tuple(_) | Expr::Map(_) | Expr::Slice(_) => true,
        Expr::Filter(f) => !(STRING_FILTERS.contains(&f.name) || KEPT_FILTERS.contains(&f.name)),
        Expr::Call(c) => match &c.expr {
            Expr::Var(v) => !PLAIN_FUNCTIONS.contains(&v.id),
            Expr::GetAttr(g) => !PLAIN_METHODS.contains(&g.name),
            _ => true,
        },
        _ => false,
    }
}

fn is_str_const(e: &Expr<'_>) -> bool {
    matches!(e, Expr::Const(c) if c.value.as_str().is_some())
}

// Whether an expression's value is a string whenever it is anything (else an error).
fn is_string(e: &Expr<'_>) -> bool {
    match e {
        Expr::Const(_) => is_str_const(e),
        Expr::BinOp(b) => match b.op {
            BinOpKind::Concat => true,
            BinOpKind::Add => is_string(&b.left) || is_string(&b.right),
            _ => false,
        },
        Expr::Filter(f) => STRING_FILTERS.contains(&f.name),
        _ => false,
    }
}
