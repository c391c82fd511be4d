//! Walking a chat template's syntax tree (minijinja's unstable machinery): the expressions
//! directly below an expression, for the walks that check or rewrite a template
//! ([`crate::skeleton`], the template's guard).
use minijinja::machinery::ast::{CallArg, Expr};

/// Calls `f` on each expression directly below `e` (operands, arguments, items), in source
/// order.
pub(crate) fn each_child<'a, 's>(e: &'a Expr<'s>, f: &mut dyn FnMut(&'a Expr<'s>)) {
    match e {
        Expr::Var(_) | Expr::Const(_) => {}
        Expr::Slice(s) => {
            f(&s.expr);
            [&s.start, &s.stop, &s.step]
                .into_iter()
                .flatten()
                .for_each(&mut *f);
        }
        Expr::UnaryOp(u) => f(&u.expr),
        Expr::BinOp(b) => {
            f(&b.left);
            f(&b.right);
        }
        Expr::Compare(c) => {
            f(&c.expr);
            c.ops.iter().for_each(|op| f(&op.expr));
        }
        Expr::IfExpr(i) => {
            f(&i.test_expr);
            f(&i.true_expr);
            if let Some(x) = &i.false_expr {
                f(x);
            }
        }
        Expr::Filter(x) => {
            if let Some(input) = &x.expr {
                f(input);
            }
            x.args.iter().for_each(|a| f(arg_expr(a)));
        }
        Expr::Test(t) => {
            f(&t.expr);
            t.args.iter().for_each(|a| f(arg_expr(a)));
        }
        Expr::GetAttr(g) => f(&g.expr),
        Expr::GetItem(g) => {
            f(&g.expr);
            f(&g.subscript_expr);
        }
        Expr::Call(c) => {
            f(&c.expr);
            c.args.iter().for_each(|a| f(arg_expr(a)));
        }
        Expr::List(l) => l.items.iter().for_each(f),
        Expr::Tuple(t) => t.items.iter().for_each(f),
        Expr::Map(m) => m.keys.iter().chain(&m.values).for_each(f),
    }
}

/// The expression of a call argument, whatever its kind.
pub(crate) fn arg_expr<'a, 's>(a: &'a CallArg<'s>) -> &'a Expr<'s> {
    match a {
        CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) | CallArg::KwargSplat(e) => e,
    }
}
