/* Printing a module tree the way PyTorch's repr does: the type, its
 * configuration from the type's describe function, then each child on its
 * own line as "(name): ...", indented by two spaces per level. */
#include "nn/internal.h"

static void print_module(FILE *f, nb_module *m, int indent) {
    char desc[256] = "";
    if (m->type->describe) m->type->describe(m, desc, sizeof desc);
    if (!m->children.n) {
        fprintf(f, "%s(%s)", m->type->name, desc);
        return;
    }
    /* with children, the configuration gets its own line, as in PyTorch */
    fprintf(f, "%s(\n", m->type->name);
    if (desc[0]) fprintf(f, "%*s%s\n", indent + 2, "", desc);
    {
        for (int i = 0; i < m->children.n; i++) {
            fprintf(f, "%*s(%s): ", indent + 2, "", m->children.v[i].name);
            print_module(f, m->children.v[i].ptr, indent + 2);
            fputc('\n', f);
        }
        fprintf(f, "%*s)", indent, "");
    }
}

void nb_module_fprint(FILE *f, nb_module *m) {
    NB_CHECK(f && m, "nb_module_fprint: file and module must not be NULL");
    print_module(f, m, 0);
    fputc('\n', f);
}

void nb_module_print(nb_module *m) { nb_module_fprint(stdout, m); }
