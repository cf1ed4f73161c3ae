// The in-page confirmation dialog (a modal <dialog>: focus moves into it, Escape cancels, focus returns after).

const dialog = () => document.getElementById("confirm");

export function confirmAction(title, body, okLabel = "Confirm") {
  const box = dialog();
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-body").textContent = body;
  const ok = document.getElementById("confirm-ok");
  ok.textContent = okLabel;
  const opener = document.activeElement;
  box.returnValue = "cancel";
  return new Promise((resolve) => {
    box.addEventListener(
      "close",
      () => {
        if (opener && opener.focus) opener.focus();
        resolve(box.returnValue === "ok");
      },
      { once: true },
    );
    box.showModal();
    document.getElementById("confirm-cancel").focus();
  });
}
